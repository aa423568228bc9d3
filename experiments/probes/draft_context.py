"""What a draft loses if it sees only the last W tokens of the prompt, and what its prefill costs (issue 34).

    python experiments/probes/draft_context.py --target smollm2-135m-instruct --draft smollm2-135m-draft \
        --out experiments/results/serving/draft_context_smollm2.json
    python experiments/probes/draft_context.py --report FILE.json          # the table (markdown)

For each prompt (the code and chat sets, chat-templated as the server sends them; and the chat set again
behind a shared system message of ``--system-tokens`` tokens, the long-prompt case) the target's greedy
continuation of ``--new-tokens`` tokens is generated once. The draft is then teacher-forced over it:
``match[i]`` says whether its greedy next token equals the target's at output position i, with the full
prompt as context and with only the prompt's last W tokens (plus the output so far). At T = 0 the mean
match is the first-position acceptance alpha of SD with that draft. RoPE scores depend only on the distance
between positions, so a window that starts at position 0 gives what a windowed cache would.

The cost side: a chunk of 64 prompt tokens through the target and through the draft (the medians of 5
timed calls after a compile), so the draft's prefill as a share of the target's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

WINDOWS = (16, 32, 64, 128, 256)


def chunk_ms(model, n: int = 64, calls: int = 5) -> float:
    """Median ms of one ``n``-token prefill chunk at context 0..n (a jitted causal forward)."""
    import jax
    import numpy as np

    from ssd_jax.models import llama

    cfg = model.cfg

    @jax.jit
    def f(params, toks):
        h, _ = llama.forward(params, cfg, toks, llama.init_cache(cfg, 1, n))
        return h[:, -1]

    toks = np.ones((1, n), np.int32)
    jax.block_until_ready(f(model.params, toks))
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(f(model.params, toks))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def measure(a) -> dict:
    from ssd_jax import SamplingParams, generate, load_model
    from ssd_jax.analysis.oracle import teacher_forced_matches
    from ssd_jax.bench.serving import system_prompt
    from ssd_jax.data.prompts import load_prompts

    target, draft = load_model(a.target), load_model(a.draft)
    tok = target.tokenizer
    system = system_prompt(tok, a.system_tokens)
    sets = {}
    for cat in ("code", "chat"):
        sets[cat] = [[{"role": "user", "content": r["prompt"]}] for r in load_prompts(cat, n=a.prompts)]
    sets[f"chat + {a.system_tokens}-token system"] = [
        [{"role": "system", "content": system}, *m] for m in sets["chat"]
    ]
    rows = []
    for name, convs in sets.items():
        for i, conv in enumerate(convs):
            ids = tok.encode(
                tok.apply_chat_template(conv, add_generation_prompt=True), add_special_tokens=False
            )
            out = generate(
                target, [ids], SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
            ).outputs[0]
            seq = ids + list(out["token_ids"])
            row = {"set": name, "prompt": i, "prompt_len": len(ids), "matches": {}}
            for w in (None, *WINDOWS):
                start = 0 if w is None or w >= len(ids) else len(ids) - w
                m = teacher_forced_matches(draft, seq[start:], len(ids) - start, vocab=target.cfg.vocab_size)
                row["matches"]["full" if w is None else str(w)] = [bool(x) for x in m]
            rows.append(row)
            print(
                name,
                i,
                len(ids),
                {k: round(sum(v) / len(v), 2) for k, v in row["matches"].items()},
                flush=True,
            )
    return {
        "target": a.target, "draft": a.draft, "new_tokens": a.new_tokens, "system_tokens": a.system_tokens,
        "rows": rows, "loadavg": os.getloadavg()[0],
        "chunk64_ms": {"target": chunk_ms(target), "draft": chunk_ms(draft)},
    }  # fmt: skip


def report(path: str) -> str:
    import numpy as np

    from ssd_jax.bench.stats import mean_ci

    d = json.load(open(path))
    c = d["chunk64_ms"]
    keys = ["full", *map(str, WINDOWS)]
    lines = [
        f"{d['target']} with {d['draft']}: first-position acceptance at T = 0 (teacher-forced on the target's "
        f"greedy {d['new_tokens']}-token output; mean over prompts [95% CI]), the draft seeing the whole "
        f"prompt or only its last W tokens. Load {d['loadavg']:.1f}.",
        "",
        "| prompts | mean prompt tokens | "
        + " | ".join("full" if k == "full" else f"W = {k}" for k in keys)
        + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for name in dict.fromkeys(r["set"] for r in d["rows"]):
        rs = [r for r in d["rows"] if r["set"] == name]
        cells = []
        for k in keys:
            m, lo, hi = mean_ci([float(np.mean(r["matches"][k])) for r in rs])
            cells.append(f"{m:.2f} [{lo:.2f}, {hi:.2f}]")
        lines.append(
            f"| {name} ({len(rs)}) | {np.mean([r['prompt_len'] for r in rs]):.0f} | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        f"A 64-token prefill chunk: target {c['target']:.1f} ms, draft {c['draft']:.1f} ms "
        f"(the draft's prefill adds {100 * c['draft'] / c['target']:.0f}% to the target's).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--prompts", type=int, default=8, help="per set")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--out")
    ap.add_argument("--report")
    a = ap.parse_args()
    if a.report:
        print(report(a.report))
        return
    d = measure(a)
    with open(a.out + ".tmp", "w") as f:
        json.dump(d, f)
    os.replace(a.out + ".tmp", a.out)
    print(report(a.out))


if __name__ == "__main__":
    main()
