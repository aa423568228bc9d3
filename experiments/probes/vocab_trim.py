"""Draft vocabulary trimming on SmolLM2-135M and its shipped 3-layer draft: acceptance and draft step
time against the number of kept tokens N (issue 13, item 2). A SMALL measurement: few prompts,
32 new tokens, one CPU shared with other jobs (the load average is recorded).

    python experiments/probes/vocab_trim.py [--ns 49152 16384 8192 4096 2048] [--prompts 4] [--tokens 32]

Per prompt (chat template, greedy, K = 4) every N runs back to back in a rotated order, twice:
SD with ``profile_stages`` (the draft's K steps are one call, synced, so ``draft_s`` is the draft's
own time) and the default one-call-per-round SD (decode tok/s). Greedy SD is exact, so every N must
emit the same tokens (checked). The kept set is the draft's cached corpus counts
(``checkpoints/smollm2-135m-draft/token_counts.npz``); "coverage" is the share of the emitted
tokens inside it. Writes ``experiments/results/vocab_trim.{json,md}``: per-run rows, and per N the
mean over prompts with a 95% t-interval.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's ssd_jax, whatever is installed

TARGET = "smollm2-135m-instruct"
DRAFT = str(ROOT / "checkpoints" / "smollm2-135m-draft")
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def ci95(xs) -> tuple[float, float]:
    """Mean and half-width of the 95% t-interval (nan with one value)."""
    xs = np.asarray(xs, float)
    if len(xs) < 2:
        return float(xs.mean()), float("nan")
    return float(xs.mean()), float(T975.get(len(xs) - 1, 1.96) * xs.std(ddof=1) / math.sqrt(len(xs)))


def prompts(n: int) -> list[dict]:
    from ssd_jax.data import load_prompts

    half = (n + 1) // 2
    return (
        load_prompts("code", half, seed=0, max_chars=400)
        + load_prompts("chat", n - half, seed=0, max_chars=400)
    )[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[49152, 16384, 8192, 4096, 2048])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "vocab_trim"))
    args = ap.parse_args(argv)

    import jax

    from ssd_jax import SamplingParams, SpecConfig, generate, load_model
    from ssd_jax.drafters import vocab as dv

    load_before = os.getloadavg()
    target = load_model(TARGET)
    full = load_model(DRAFT)
    counts = dv.draft_token_counts(full, DRAFT)
    V = full.cfg.vocab_size
    drafts, kept = {}, {}
    for n in args.ns:
        if n >= V:
            drafts[n], kept[n] = full, np.arange(V)
        else:
            kept[n] = dv.kept_ids(counts, n, dv.always_kept(full.tokenizer))
            drafts[n] = dv.trim_draft(full, kept[n])
    micro = draft_call_ms(drafts, args.k, V)
    sp = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    rows = []
    ps = prompts(args.prompts)
    for i, p in enumerate(ps):
        order = args.ns[i % len(args.ns) :] + args.ns[: i % len(args.ns)]
        ref = None
        for n in order:
            row = {"prompt": p["id"], "category": p["category"], "n": n}
            for profile in (True, False):
                spec = SpecConfig(method="sd", draft=drafts[n], k=args.k, profile_stages=profile)
                res = generate(target, [p["prompt"]], sp, spec, chat=True)
                m, toks = res.metrics, res.outputs[0]["token_ids"]
                ref = toks if ref is None else ref
                row["same_tokens"] = row.get("same_tokens", True) and toks == ref
                if profile:
                    row.update(
                        acceptance=m["acceptance_rate"],
                        tokens_per_round=m["mean_acceptance_length"],
                        rounds=m["verify_steps"],
                        draft_s=m["draft_s"],
                        verify_s=m["verify_s"],
                        draft_ms_per_step=1e3 * m["draft_s"] / (m["verify_steps"] * args.k),
                        verify_ms_per_round=1e3 * m["verify_s"] / m["verify_steps"],
                        coverage=float(np.isin(toks, kept[n]).mean()),
                    )
                else:
                    row["decode_tok_s"] = m["decode_tokens_per_s"]
            row["loadavg"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "target": TARGET,
        "draft": "checkpoints/smollm2-135m-draft",
        "k": args.k,
        "new_tokens": args.tokens,
        "prompts": [p["id"] for p in ps],
        "vocab": V,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
    }
    summary = []
    for n in args.ns:
        r = [x for x in rows if x["n"] == n]
        s = {"n": n, "head_share_of_draft_bytes": head_share(full, n)}
        for key in (
            "acceptance",
            "tokens_per_round",
            "draft_ms_per_step",
            "verify_ms_per_round",
            "decode_tok_s",
            "coverage",
        ):
            s[key] = ci95([x[key] for x in r])
        s["draft_call_ms"] = ci95(micro[n])
        full_n = max(args.ns)  # paired by round: robust to the load drifting between rounds
        s["draft_call_vs_largest"] = ci95(np.asarray(micro[n]) / np.asarray(micro[full_n]))
        s["same_tokens_as_full"] = all(x["same_tokens"] for x in r)
        summary.append(s)
    out = {"environment": env, "summary": summary, "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    Path(args.out + ".md").write_text(render(out))
    print(render(out))
    return 0


def draft_call_ms(
    drafts: dict, k: int, vocab: int, reps: int = 10, calls: int = 10
) -> dict[int, list[float]]:
    """ms per draft step of the real draft call (``drafters.model.draft_propose``: K greedy steps
    with sampling and q, batch 1, context 64), measured alone: ``reps`` rounds over every N in turn,
    ``calls`` calls each; one mean per round."""
    import functools

    import jax
    import jax.numpy as jnp

    from ssd_jax import SamplingParams
    from ssd_jax.drafters.model import draft_propose
    from ssd_jax.models import llama
    from ssd_jax.sampling.filters import RowSampling

    rs = RowSampling.broadcast(SamplingParams(), 1)
    key, tok = jax.random.PRNGKey(0), jnp.zeros((1,), jnp.int32)
    progs = {}
    for n, m in drafts.items():
        fn = jax.jit(
            functools.partial(draft_propose, cfg=m.cfg, k=k, vocab=vocab, needs_filter=False, catch_up=False)
        )
        cache = llama.init_cache(m.cfg, 1, 128).with_lengths(jnp.full((1,), 64, jnp.int32))
        jax.block_until_ready(fn(m.params, cache, tok, tok, key, rs))
        progs[n] = (fn, m.params, cache)
    out: dict[int, list[float]] = {n: [] for n in drafts}
    for _ in range(reps):
        for n, (fn, params, cache) in progs.items():
            t = time.perf_counter()
            for _ in range(calls):
                r = fn(params, cache, tok, tok, key, rs)
            jax.block_until_ready(r)
            out[n].append(1e3 * (time.perf_counter() - t) / (calls * k))
    return out


def head_share(model, n: int) -> float:
    """The head's share of the draft's weight bytes read per step (layers + final norm + head)."""
    from ssd_jax.models.params import count_params

    cfg = model.cfg
    body = count_params(cfg) - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    head = min(n, cfg.vocab_size) * cfg.hidden_size
    return head / (body + head)


def render(out: dict) -> str:
    env = out["environment"]

    def f(v, d=2):
        m, h = v
        return f"{m:.{d}f}" if math.isnan(h) else f"{m:.{d}f} ± {h:.{d}f}"

    lines = [
        "# Draft vocabulary trimming: acceptance and draft step time against N (small measurement)",
        "",
        f"SmolLM2-135M-Instruct target, its shipped 3-layer draft (`checkpoints/smollm2-135m-draft`), "
        f"{len(env['prompts'])} prompts ({', '.join(env['prompts'])}), chat template, greedy, K = {env['k']}, "
        f"{env['new_tokens']} new tokens, batch 1, f32 on the 2-core CPU. Every N runs back to back per prompt. "
        f"Values: mean over prompts ± the 95% t-interval half-width (n = {len(env['prompts'])}: wide). "
        f"Load average (1 min) before {env['loadavg_before'][0]:.2f}, after {env['loadavg_after'][0]:.2f}; "
        f"commit {env['commit']}, `python experiments/probes/vocab_trim.py`.",
        "",
        "Draft call ms/step (alone): the real draft call (`drafters.model.draft_propose`, K greedy steps with "
        "sampling and q, context 64) timed on its own, 10 rounds over every N in turn x 10 calls, divided by K "
        '(interval over the 10 rounds); "vs largest N": the same, as a ratio to the largest N within each round. Draft ms/step (in SD): the profiled SD run\'s draft stage (K steps, one '
        "sync) divided by K (interval over prompts). The kept set: the N most "
        "frequent tokens of 16M characters of the training corpus, special tokens always in. Coverage: share "
        "of the emitted (= AR) tokens inside the kept set.",
        "",
        "| N kept | head share of draft bytes | draft call ms/step (alone) | vs largest N | draft ms/step (in SD) | "
        "coverage | acceptance | tokens/round | verify ms/round | SD decode tok/s | same tokens as full |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in out["summary"]:
        lines.append(
            f"| {s['n']} | {s['head_share_of_draft_bytes']:.2f} | {f(s['draft_call_ms'], 1)} | "
            f"{f(s['draft_call_vs_largest'])} | "
            f"{f(s['draft_ms_per_step'], 1)} | {f(s['coverage'], 3)} | {f(s['acceptance'], 3)} | "
            f"{f(s['tokens_per_round'])} | {f(s['verify_ms_per_round'], 1)} | "
            f"{f(s['decode_tok_s'])} | {'yes' if s['same_tokens_as_full'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
