"""What the planner measures on this machine: the target's greedy continuation of built-in prompts,
the draft's acceptance and the rank of each target token among its logits on it, and the stage
costs at the run's batch (:mod:`ssd_jax.planning.records` caches them; the models of
:mod:`ssd_jax.planning.sd_model`, :mod:`~ssd_jax.planning.ssd_model` and
:mod:`~ssd_jax.planning.head_model` price rounds with them).

* ``t_ar``: median time of the target's compiled one-token decode step (:data:`TIMED_STEPS` steps);
* ``t_verify(K+1)``: median time of the compiled verify forward at K + 1 tokens per row for K in
  :data:`VERIFY_KS`;
* ``t_draft_step``: the draft model's compiled one-token forward with its logits (0 for n-gram /
  random), and for SSD the same at several row counts (``t_draft_rows``, its build);
* ``c_round``: the host's n-gram lookup for the batch (0 for model / random drafts);
* ``α``: the draft's GREEDY acceptance on the target's greedy continuation, by an offline simulation
  of SD rounds at K = 8 (the draft's argmax on the target's tokens, teacher-forced; n-gram: the lookup
  itself), as the maximum-likelihood estimate of a geometric acceptance: accepted / (accepted +
  rejections). Random proposals: α = 1/V. :data:`ALPHA_PRIOR` (``alpha_source: "prior"``) only
  when the continuation gives no evidence (a context window too short to calibrate in).

The rows are the built-in texts (raw code and prose, :data:`CAL_TEXTS`) and chat requests in the
model's chat template (:data:`CAL_CHATS`), one row each whatever the batch; the costs are timed at the
run's batch size.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from ssd_jax.decoding.sd import sd_steps
from ssd_jax.decoding.spec import K_MAX
from ssd_jax.drafters.ngram import ngram_lookup, ngram_proposals
from ssd_jax.parallel.placement import cache_for, put_on

#: raw text continued as it is (code, prose)
CAL_TEXTS = (
    "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):\n"
    "        if n % i == 0:\n            return False\n    return True\n",
    "The river flows from the mountains to the sea. Along the way it passes forests, fields and "
    "small towns, where people fish, swim and watch the boats go by.",
)
#: requests answered as a chat model answers them: in the model's chat template when it has one
#: (the last P_LEN ids, which end where the assistant's answer starts), as raw text otherwise
CAL_CHATS = (
    "Write a Python function that reverses a list.",
    "Explain briefly why the sky is blue.",
    "What is 17 times 23? Show the steps.",
    "Give three tips for writing clear emails.",
)
#: prompt ids per calibration row, tokens the target continues greedily, timing repetitions, and
#: the steps timed for the per-step costs
P_LEN, N_GEN, REPS, TIMED_STEPS = 24, 32, 5, 8
VERIFY_KS = (1, 4, 8)
ALPHA_PRIOR = 0.6
#: rows of the acceptance measurement: every calibration text once, whatever the batch
N_CAL_ROWS = len(CAL_TEXTS) + len(CAL_CHATS)


def _cal_ids(model, n_rows: int) -> np.ndarray:
    """(rows, P_LEN) fixed prompt ids: the built-in texts and chat requests (row b takes text
    b mod their number), or seeded ids without a tokenizer."""
    V, tok = model.cfg.vocab_size, model.tokenizer
    if tok is not None:
        chat = tok.chat_template is not None
        texts = [(t, False) for t in CAL_TEXTS] + [
            (tok.apply_chat_template([{"role": "user", "content": q}]) if chat else q, chat)
            for q in CAL_CHATS
        ]
        base = []
        for text, templated in texts:
            ids = [i for i in tok.encode(text, add_special_tokens=not templated) if 0 <= i < V]
            base.append(ids[-P_LEN:] if templated else ids[:P_LEN])
    else:
        rng = np.random.default_rng(0)
        base = [rng.integers(2, V, P_LEN).tolist() for _ in range(N_CAL_ROWS)]
    base = [np.resize(np.asarray(b or [0], np.int32), P_LEN) for b in base]
    return np.stack([base[b % len(base)] for b in range(n_rows)])


def _median_time(fn, reps: int = REPS) -> float:
    fn()  # warm: compiles on the first call
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def _step_through(model, seq: np.ndarray, start: int, max_len: int, generate: bool, ranks=None, timing=False):
    """Feed ``seq`` (B, L) to ``model`` one token per compiled call (the 1-token verify forward, logits
    included). With ``generate``, positions after ``start`` are overwritten by the greedy continuation.
    Returns (the model's argmax after each position (B, L - 1), median seconds per step from position
    ``start`` on, the cache holding positions 0..L-2). ``ranks``: a (B, L - 1) array to fill with the
    rank of ``seq``'s next token among the model's logits (0: its argmax). ``timing``: only the
    time matters, so positions before ``start - 1`` are not computed (the cache's contents there
    are zeros; a step costs the same)."""
    B, L = seq.shape
    put = functools.partial(put_on, model)
    score, _ = sd_steps(model.cfg, False)
    cache, none = cache_for(model, B, max_len), put(np.zeros((B, 0), np.int32))
    first = max(start - 1, 0) if timing else 0  # one untimed step first: it compiles
    cache = cache.with_lengths(cache.lengths + first)
    pred, times = np.zeros((B, L - 1), np.int32), []
    for i in range(first, L - 1):
        tok = put(seq[:, i])
        t = time.perf_counter()
        logits, cache = score(model.params, cache, tok, none)
        logits.block_until_ready()
        if i >= start:
            times.append(time.perf_counter() - t)
        cache = cache.with_lengths(cache.lengths + 1)
        lg = np.asarray(logits[:, 0])
        pred[:, i] = lg.argmax(-1)
        if ranks is not None:
            nxt = lg[np.arange(B), seq[:, i + 1]]
            ranks[:, i] = (lg > nxt[:, None]).sum(-1)
        if generate and i + 1 > start:
            seq[:, i + 1] = pred[:, i]
    return pred, float(np.median(times)) if times else None, cache


def _simulate_alpha(seq: np.ndarray, start: int, propose) -> tuple[int, int]:
    """(accepted, rejections) of greedy SD rounds at K = K_MAX over one row's continuation."""
    acc = rej = 0
    t = start
    while t + K_MAX <= len(seq):
        prop = np.asarray(propose(t))[:K_MAX]
        match = prop == seq[t : t + len(prop)]
        a = int(np.argmin(match)) if not match.all() else len(prop)
        acc, rej, t = acc + a, rej + (a < len(prop)), t + a + 1
    return acc, rej


def target_part(model, batch: int, seq: np.ndarray | None = None) -> dict:
    """The target's side of a calibration: its greedy continuation of every calibration prompt
    (``seq``, one row each, whatever the batch: what α and the ranks are measured on; given, it is
    reused), and at the run's ``batch`` rows ``t_ar`` and ``t_verify`` (the same for every draft)."""
    n_gen = max(0, min(N_GEN, model.cfg.max_position_embeddings - P_LEN - 2 * K_MAX - 2))
    max_len = P_LEN + n_gen + 2 * K_MAX + 2
    put = functools.partial(put_on, model)
    R, B = N_CAL_ROWS, batch
    if seq is None:
        seq = np.zeros((R, P_LEN + 1 + n_gen), np.int32)  # prompt, then the target's greedy continuation
        seq[:, :P_LEN] = _cal_ids(model, R)
        _step_through(model, seq, P_LEN - 1, max_len, generate=True)
    seq_b = _timing_rows(seq, B)
    _, t_ar, cache = _step_through(model, seq_b, P_LEN, max_len, generate=False, timing=True)
    score, _ = sd_steps(model.cfg, False)
    state = {"cache": cache}
    cur = put(seq_b[:, -1])

    def verify(k):
        zk = put(np.zeros((B, k), np.int32))

        def run():
            logits, state["cache"] = score(model.params, state["cache"], cur, zk)
            logits.block_until_ready()

        return run

    t_verify = {k: _median_time(verify(k)) for k in VERIFY_KS}
    if t_ar is None:
        t_ar = t_verify[1]
    return {
        "seq": seq,
        "seq_b": seq_b,
        "n_gen": n_gen,
        "max_len": max_len,
        "t_ar": t_ar,
        "t_verify": t_verify,
    }


def _timing_rows(seq: np.ndarray, rows: int) -> np.ndarray:
    """``rows`` rows (the calibration rows in turn) of the prompts and the first TIMED_STEPS tokens
    of their continuations: what a per-step cost is timed on."""
    n = P_LEN + 1 + min(TIMED_STEPS, seq.shape[1] - P_LEN - 1)
    return np.resize(seq[:, :n], (rows, n))


def draft_part(spec, draft, target: dict, rand_vocab: int, row_counts=()) -> dict:
    """The draft's side: α on the target's continuation and its per-round costs, assembled with
    ``target`` (:func:`target_part`) into a calibration record. A draft model also records the
    rank of each target token among its logits (SSD's hits), and with ``row_counts`` the time of
    one draft step at each of those row counts (SSD's build)."""
    seq, seq_b, n_gen, max_len = target["seq"], target["seq_b"], target["n_gen"], target["max_len"]
    extra: dict = {}
    rows = seq.shape[0]
    acc = rej = 0
    t_draft_step = c_round = 0.0
    alpha_source = "measured"
    if spec.draft == "random":
        alpha, alpha_source = 1.0 / rand_vocab, "exact"
    elif spec.draft == "ngram":
        hist = [seq[b % rows] for b in range(seq_b.shape[0])]
        c_round = _median_time(
            lambda: ngram_proposals(hist, K_MAX, spec.prompt_lookup_min, spec.prompt_lookup_max)
        )
        for b in range(rows):
            a, r = _simulate_alpha(
                seq[b],
                P_LEN + 1,
                lambda t, b=b: ngram_lookup(
                    seq[b, :t], K_MAX, spec.prompt_lookup_min, spec.prompt_lookup_max
                ),
            )
            acc, rej = acc + a, rej + r
    else:
        # the draft teacher-forced on the target's tokens, one step per call: its greedy proposal j of
        # a round is right exactly when proposals 1..j are, so the leading matches are its rounds;
        # the step's cost is timed separately at the run's batch
        ranks = np.zeros((rows, seq.shape[1] - 1), np.int64)
        pred, _, _ = _step_through(draft, seq, P_LEN, max_len, generate=False, ranks=ranks)
        extra["ranks"], extra["rank_start"] = ranks.tolist(), P_LEN + 1
        t_draft_step = _step_through(draft, seq_b, P_LEN, max_len, generate=False, timing=True)[1]
        if row_counts:  # SSD's build: one draft step at many rows
            t_rows = {}
            for R in row_counts:
                if R == seq_b.shape[0]:
                    t_rows[str(R)] = t_draft_step
                    continue
                seq_r = _timing_rows(seq, R)
                t_rows[str(R)] = _step_through(draft, seq_r, P_LEN, max_len, generate=False, timing=True)[1]
            extra["t_draft_rows"] = t_rows
            extra["t_build"] = time_build(draft, seq_b, max_len, *BUILD_PROBE)
        for b in range(rows):
            a, r = _simulate_alpha(seq[b], P_LEN + 1, lambda t, b=b: pred[b, t - 1 : t - 1 + K_MAX])
            acc, rej = acc + a, rej + r
    if spec.draft != "random":
        if acc + rej:
            alpha = acc / (acc + rej)
        else:
            alpha, alpha_source = (
                (0.0, "measured") if spec.draft == "ngram" and n_gen else (ALPHA_PRIOR, "prior")
            )
    costs = {
        "t_ar": target["t_ar"],
        "t_verify": {str(k): v for k, v in target["t_verify"].items()},
        "t_draft_step": t_draft_step,
        "c_round": c_round,
    }
    if "t_draft_rows" in extra:
        costs["t_draft_rows"] = extra.pop("t_draft_rows")
        costs["t_build"] = extra.pop("t_build")
    return {
        **extra,
        "alpha": float(alpha),
        "alpha_source": alpha_source,
        "costs": costs,
        "calibration_tokens": int(rows * (seq.shape[1] - P_LEN)),
    }


#: the (K, M) at which SSD's whole tree build is timed once (:func:`time_build`)
BUILD_PROBE = (3, 12)


def time_build(draft, seq_b: np.ndarray, max_len: int, K: int, M: int) -> dict:
    """The median seconds of SSD's whole cache build (:func:`ssd_jax.decoding.ssd.tree.build_tree`: the
    re-run of K + 1 tokens, the top-M candidates over the vocabulary, M branches decoded K steps under the
    tree mask) at ``seq_b``'s rows, greedy, on a cache of the run's shape (its contents do not change the
    cost). The round model composes a build from draft steps at several row counts; this one measurement
    scales that composition to what the build's own work (candidates, sampling over every branch, the
    tree's attention) adds. Returns {"k", "budget", "rows", "s"}."""
    import jax

    from ssd_jax.decoding.ssd import tree as ssd_tree
    from ssd_jax.decoding.ssd.fanout import branch_layout, geometric_fanout
    from ssd_jax.sampling.filters import RowSampling
    from ssd_jax.sampling.filters import SamplingParams

    B = seq_b.shape[0]
    put = functools.partial(put_on, draft)
    cache = cache_for(draft, B, max_len + M * K)
    cache = cache.with_lengths(cache.lengths + P_LEN)
    sched = geometric_fanout(0.7, 0.4, K, M)
    kb, rb = branch_layout(np.broadcast_to(sched, (B, K + 1)), M)
    V = draft.cfg.vocab_size
    opts = ssd_tree.Opts(k=K, budget=M, vocab=V, rand_vocab=V, needs_filter=False, greedy=True, c=1.0,
                         tree_base=max_len)  # fmt: skip
    toks = np.resize(seq_b[:, P_LEN:], (B, K + 1)).astype(np.int32)
    args = (
        draft.params, cache, put(toks[:, 0]), put(toks[:, 1:]), put(np.full(B, K, np.int32)), put(kb), put(rb),
        put(np.broadcast_to(sched[:K], (B, K)).astype(np.int32)), jax.random.key(0),
        jax.tree.map(put, RowSampling.broadcast(SamplingParams(temperature=0.0), B)),
    )  # fmt: skip
    build = jax.jit(functools.partial(ssd_tree.build_tree, cfg=draft.cfg, opts=opts))
    s = _median_time(lambda: jax.block_until_ready(build(*args)), reps=3)
    return {"k": K, "budget": M, "rows": B, "s": s}


def calibrate(model, spec, draft, batch: int, rand_vocab: int) -> dict:
    """Measure α and the stage costs (seconds) at ``batch`` rows; see the module docstring."""
    return draft_part(spec, draft, target_part(model, batch), rand_vocab)
