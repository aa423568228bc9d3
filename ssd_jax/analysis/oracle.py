"""Offline acceptance analysis of greedy speculative decoding: oracle bounds, n-gram vs draft.

Under greedy decoding the output is fixed: speculative decoding emits exactly the target's
autoregressive output, whatever the drafter proposes. So how many proposals a round would
accept can be read off the final token sequence, without running the speculative loop:

* an n-gram (prompt-lookup) drafter at output position t proposes
  ``ngram_lookup(tokens[:prompt_len + t])`` and gets its longest prefix that equals the true
  continuation accepted (:func:`ngram_accept_lengths`);
* a greedy draft model proposes a chain that follows the true sequence until its first
  wrong token, so with ``match[i]`` = "the draft's argmax after the true prefix of output
  position i is the true token" (:func:`teacher_forced_matches`, one causal forward), its
  accepted count at i is the run of True starting at i, capped at K (:func:`run_lengths`).

Given accepted lengths per position, :func:`simulate_rounds` walks the output round by
round (accept ``a`` proposals plus one bonus/correction token, move ``a + 1``) and reports
tokens per round. Two bounds from the vLLM speculative-decoding study are built from the
same arrays: the *oracle* proposer that always proposes exactly what will be accepted
(:func:`oracle_lengths`, K + 1 tokens per round until the end), and the *oracle combine*
that picks, every round, whichever of n-gram and draft gets more accepted
(:func:`combine`). :func:`analyze` does one prompt, :func:`aggregate` pools prompts overall
and by BLEU-4 bin of output-vs-prompt overlap (:func:`bleu4`), and
:func:`render_markdown` writes the two tables.

Round model: the walk starts at output position 0, so the first output token is also
treated as the end of a speculative round. The engine emits that token from the prefill
with no proposals, so its verify-step count for a row equals
``simulate_rounds(accept_len[1:], k)["rounds"]`` (one fewer token, no prefill round).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

DEFAULT_BLEU_EDGES = (0.0, 0.1, 0.2, 0.4, 1.0)
METHODS = ("ngram", "draft", "oracle", "combine")


# --- prompt-output overlap ------------------------------------------------------------------


def _ngram_counts(tokens: Sequence[int], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def bleu4(candidate: Sequence[int], reference: Sequence[int], brevity_penalty: bool = True) -> float:
    """Sentence-level BLEU-4 of ``candidate`` (the output) against one ``reference`` (the prompt).

    ``exp(mean_n log p_n) * BP`` over n = 1..4, where p_n is the modified (clipped) n-gram
    precision: each candidate n-gram counts at most as often as it occurs in the reference.
    Smoothing: add-one for n >= 2 (p_n = (matches + 1) / (candidate n-grams + 1), Lin & Och's
    "BLEU+1"); unigrams are not smoothed, so no shared token at all gives 0. The brevity
    penalty is ``exp(1 - r / c)`` when the candidate (length c) is shorter than the
    reference (length r), else 1 (``brevity_penalty=False``: always 1). An empty candidate
    scores 0.0.
    """
    cand, ref = [int(x) for x in candidate], [int(x) for x in reference]
    c, r = len(cand), len(ref)
    if c == 0:
        return 0.0
    log_p = 0.0
    for n in range(1, 5):
        cand_n, ref_n = _ngram_counts(cand, n), _ngram_counts(ref, n)
        matches = sum(min(cnt, ref_n[g]) for g, cnt in cand_n.items())
        total = sum(cand_n.values())
        smooth = 1 if n >= 2 else 0
        if matches + smooth == 0:
            return 0.0
        log_p += math.log((matches + smooth) / (total + smooth))
    bp = 1.0 if c > r or not brevity_penalty else math.exp(1.0 - r / c)
    return bp * math.exp(log_p / 4)


def _bin_labels(edges: Sequence[float]) -> list[str]:
    return [f"{float(lo)}-{float(hi)}" for lo, hi in zip(edges[:-1], edges[1:])]


def bleu_bin(score: float, edges: Sequence[float] = DEFAULT_BLEU_EDGES) -> str:
    """Label ``"lo-hi"`` of the bin ``lo <= score < hi`` (the last bin also holds its upper edge)."""
    if not edges[0] <= score <= edges[-1]:
        raise ValueError(f"score {score} outside the bin edges {tuple(edges)}")
    i = int(np.searchsorted(np.asarray(edges[1:-1], float), score, side="right"))
    return _bin_labels(edges)[i]


# --- accepted lengths per output position ---------------------------------------------------


def ngram_accept_lengths(
    tokens: Sequence[int], prompt_len: int, k: int, n_min: int = 1, n_max: int = 4
) -> np.ndarray:
    """Accepted count of the n-gram drafter's proposal at each output position.

    Entry ``t - prompt_len`` for t in [prompt_len, len(tokens)): how many leading tokens of
    ``ngram_lookup(tokens[:t], k, n_min, n_max)`` equal ``tokens[t : t + k]`` (0 when the
    lookup finds nothing).
    """
    # the n-gram drafter's own lookup (a pure numpy function): the simulation must propose
    # exactly what the engine's drafter proposes
    from ssd_jax.drafters.ngram import ngram_lookup

    tokens_T = np.asarray(tokens, np.int32)
    out = np.zeros(len(tokens_T) - prompt_len, np.int64)
    for t in range(prompt_len, len(tokens_T)):
        prop = ngram_lookup(tokens_T[:t], k, n_min, n_max)
        truth = tokens_T[t : t + len(prop)]
        agree = prop[: len(truth)] == truth
        out[t - prompt_len] = len(agree) if agree.all() else int(np.argmin(agree))
    return out


def run_lengths(match: np.ndarray, k: int) -> np.ndarray:
    """For each i, the number of consecutive True in ``match`` starting at i, capped at k.

    With ``match[i]`` = "the model's greedy token at output position i is the true one", this
    is the accepted count of a greedy k-token draft chain proposed at i.
    """
    match_N = np.asarray(match, bool)
    n = len(match_N)
    run = np.zeros(n + 1, np.int64)
    for i in range(n - 1, -1, -1):
        run[i] = run[i + 1] + 1 if match_N[i] else 0
    return np.minimum(run[:n], k)


def oracle_lengths(n: int, k: int) -> np.ndarray:
    """Accepted counts of a proposer that proposes exactly what will be accepted: min(k, n - t - 1)."""
    return np.minimum(k, n - 1 - np.arange(n)).astype(np.int64)


def combine(len_a: np.ndarray, len_b: np.ndarray) -> np.ndarray:
    """Oracle combine of two proposers: each round uses whichever gets more accepted."""
    a, b = np.asarray(len_a), np.asarray(len_b)
    if a.shape != b.shape:
        raise ValueError(f"accepted-length arrays differ in shape: {a.shape} vs {b.shape}")
    return np.maximum(a, b)


def _length_bucket(n: int) -> int:
    """Padded sequence length: powers of two from 16, so sequence lengths compile a handful of shapes."""
    b = 16
    while b < n:
        b *= 2
    return b


@functools.lru_cache(maxsize=16)
def _greedy_next_fn(cfg, vocab: int | None):
    import jax
    import jax.numpy as jnp

    from ssd_jax.models import llama

    def greedy_next(params, tokens_1xT):
        B, T = tokens_1xT.shape
        hidden_1xTxD, _ = llama.forward(params, cfg, tokens_1xT, llama.init_cache(cfg, B, T))
        logits_1xTxV = llama.logits(params, cfg, hidden_1xTxD)
        if vocab is not None:
            # cut to the target's vocabulary; a draft with a smaller table would be padded with
            # -inf, which never changes the argmax
            logits_1xTxV = logits_1xTxV[..., :vocab]
        return jnp.argmax(logits_1xTxV, axis=-1).astype(jnp.int32)

    return jax.jit(greedy_next)


def teacher_forced_matches(
    model, tokens: Sequence[int], prompt_len: int, vocab: int | None = None
) -> np.ndarray:
    """Whether ``model``'s greedy next token is the true one, at every output position.

    One jitted causal forward of the whole sequence (padded to a power-of-two length bucket,
    which a causal model cannot see from earlier positions). ``match[i] = argmax(logits at
    prompt_len + i - 1) == tokens[prompt_len + i]`` for i in [0, len(tokens) - prompt_len).
    ``vocab``: cut or pad the logits to the target's vocabulary first, as the engine does
    for a draft whose embedding table is padded differently.
    """
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1 (the first output token needs a context)")
    tokens_T = np.asarray(tokens, np.int32)
    T = len(tokens_T)
    padded_1xP = np.zeros((1, _length_bucket(T)), np.int32)
    padded_1xP[0, :T] = tokens_T
    next_1xP = np.asarray(_greedy_next_fn(model.cfg, vocab)(model.params, padded_1xP))
    return next_1xP[0, prompt_len - 1 : T - 1] == tokens_T[prompt_len:]


# --- rounds -----------------------------------------------------------------------------------


def simulate_rounds(accept_len: np.ndarray, k: int) -> dict:
    """Walk an output of n tokens round by round with the given accepted counts per position.

    From t = 0, a round at t accepts ``a = min(accept_len[t], n - t - 1, k)`` proposals (the
    end cap keeps the bonus token inside the output) plus one bonus/correction token: t += a + 1.
    ``per_position_acceptance[j - 1]`` is the fraction of ALL rounds whose j-th proposal was
    accepted (a >= j), so rounds cut short by the end of the output count as misses.
    """
    acc_N = np.asarray(accept_len, np.int64)
    n = len(acc_N)
    accepted_at = np.zeros(k, np.int64)
    rounds = t = 0
    while t < n:
        a = int(min(acc_N[t], n - t - 1, k))
        accepted_at[:a] += 1
        rounds += 1
        t += a + 1
    return {
        "rounds": rounds,
        "tokens": n,
        "tokens_per_round": n / rounds if rounds else 0.0,
        "accepted_at": accepted_at.tolist(),
        "per_position_acceptance": (accepted_at / rounds if rounds else accepted_at * 0.0).tolist(),
    }


def analyze(
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    draft_matches: np.ndarray,
    k: int,
    n_min: int = 1,
    n_max: int = 4,
    edges: Sequence[float] = DEFAULT_BLEU_EDGES,
) -> dict:
    """Overlap and simulated rounds of every method for one prompt's greedy output.

    ``draft_matches``: :func:`teacher_forced_matches` of the draft on prompt + output.
    """
    prompt, output = [int(x) for x in prompt_tokens], [int(x) for x in output_tokens]
    n = len(output)
    if len(draft_matches) != n:
        raise ValueError(f"draft_matches has {len(draft_matches)} entries for {n} output tokens")
    ngram = ngram_accept_lengths(prompt + output, len(prompt), k, n_min, n_max)
    draft = run_lengths(draft_matches, k)
    lengths = {
        "ngram": ngram,
        "draft": draft,
        "oracle": oracle_lengths(n, k),
        "combine": combine(ngram, draft),
    }
    # overlap of the output with the prompt: BLEU-4 without the brevity penalty, which would
    # punish every output shorter than its prompt (most of them) whatever it copied
    score = bleu4(output, prompt, brevity_penalty=False)
    return {
        "prompt_len": len(prompt),
        "output_len": n,
        "k": k,
        "bleu4": score,
        "bleu_bin": bleu_bin(score, edges),
        "methods": {m: simulate_rounds(lengths[m], k) for m in METHODS},
    }


def _pool(results: list[dict]) -> dict:
    out = {}
    for m in METHODS:
        sims = [r["methods"][m] for r in results]
        rounds = sum(s["rounds"] for s in sims)
        tokens = sum(s["tokens"] for s in sims)
        accepted_at = np.sum([s["accepted_at"] for s in sims], axis=0) if sims else np.zeros(0)
        out[m] = {
            "rounds": rounds,
            "tokens": tokens,
            "tokens_per_round": tokens / rounds if rounds else 0.0,
            "per_position_acceptance": (accepted_at / rounds).tolist() if rounds else [],
        }
    return out


def aggregate(results: list[dict], edges: Sequence[float] = DEFAULT_BLEU_EDGES) -> dict:
    """Pool :func:`analyze` results: tokens and rounds summed over prompts, per method and per BLEU bin."""
    bins = {}
    for label in _bin_labels(edges):
        members = [r for r in results if r["bleu_bin"] == label]
        bins[label] = {"n_prompts": len(members), "methods": _pool(members)}
    return {
        "n_prompts": len(results),
        "k": results[0]["k"] if results else None,
        "methods": _pool(results),
        "bins": bins,
    }


def render_markdown(agg: dict) -> str:
    """Two tables: oracle bounds (tokens per round per method) and n-gram vs draft by BLEU-4 bin."""
    names = {"ngram": "n-gram", "draft": "draft model", "oracle": "oracle", "combine": "oracle combine"}
    lines = [
        f"Oracle bounds (greedy, K = {agg['k']}, {agg['n_prompts']} prompts)",
        "",
        "| method | tokens/round | rounds | tokens | per-position acceptance |",
        "|---|---|---|---|---|",
    ]
    for m in METHODS:
        s = agg["methods"][m]
        pos = ", ".join(f"{p:.2f}" for p in s["per_position_acceptance"])
        lines.append(f"| {names[m]} | {s['tokens_per_round']:.2f} | {s['rounds']} | {s['tokens']} | {pos} |")
    lines += [
        "",
        "n-gram vs draft model by BLEU-4 of output vs prompt (tokens/round)",
        "",
        "| BLEU-4 bin | prompts | n-gram | draft model | oracle combine |",
        "|---|---|---|---|---|",
    ]
    for label, b in agg["bins"].items():
        if b["n_prompts"] == 0:
            lines.append(f"| {label} | 0 | - | - | - |")
            continue
        tpr = [b["methods"][m]["tokens_per_round"] for m in ("ngram", "draft", "combine")]
        lines.append(f"| {label} | {b['n_prompts']} | " + " | ".join(f"{x:.2f}" for x in tpr) + " |")
    return "\n".join(lines) + "\n"
