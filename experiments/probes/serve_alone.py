"""One request at a time in an 8-slot server, with and without batch buckets, against offline batch 1.

    python experiments/probes/serve_alone.py --target smollm2-135m-instruct --out FILE.json
    python experiments/probes/serve_alone.py --report FILE.json     # the table (markdown)

Starts one server per (method, --batch-buckets) on free ports, all at once (an idle server waits on a
condition variable, it does not spin), and loads the target in this process for offline ``generate()``.
Per repeat and prompt (the code and chat sets, 8 each) it runs every configuration once, in a shuffled
order, one request alone: a streamed greedy chat completion of ``--new-tokens`` tokens (``ignore_eos``).
TPOT is (last token - first token) / (tokens - 1) from the stream's arrival times; offline TPOT is
``generate()``'s ``tpot_s`` for the same prompt at batch 1. The JSON holds every call and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))


def stream_tpot(url: str, prompt: str, new: int) -> dict:
    import httpx

    body = {
        "model": "served", "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "max_completion_tokens": new, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0, stamps, tokens = time.perf_counter(), [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if any((c.get("delta") or {}).get("content") for c in ch.get("choices") or []):
                stamps.append(time.perf_counter())
            if ch.get("usage"):
                tokens = ch["usage"]["completion_tokens"]
    return {"ttft_s": stamps[0] - t0, "tpot_s": (stamps[-1] - stamps[0]) / (tokens - 1), "tokens": tokens}


def report(path: str) -> str:
    """Per method and configuration: mean TPOT and TTFT, and TPOT / offline batch-1 TPOT, paired per
    (prompt, repeat), a prompt's repeats averaged in log space, the 95% t-interval over prompts."""
    from collections import defaultdict

    from ssd_jax.bench.stats import clustered, mean_ci, ratio_ci

    d = json.load(open(path))
    by = defaultdict(dict)
    for c in d["calls"]:
        by[(c["prompt"], c["repeat"])][c["config"]] = c
    lines = [
        f"{d['target']}, {d['max_batch']} slots, {d['new_tokens']} tokens, one request at a time",
        "",
        "| method | where | TPOT ms | TTFT ms | TPOT / offline batch 1 | load |",
        "|---|---|---|---|---|---|",
    ]
    for cfg in sorted({c["config"] for c in d["calls"]}):
        m = cfg.split("/")[0]
        rows = [v for v in by.values() if cfg in v and f"{m}/offline" in v]
        tpot = mean_ci([v[cfg]["tpot_s"] * 1e3 for v in rows])[0]
        ttft = mean_ci([v[cfg]["ttft_s"] * 1e3 for v in rows])[0]
        ratios = clustered(
            ((k[0], v[cfg]["tpot_s"] / v[f"{m}/offline"]["tpot_s"]) for k, v in by.items() if v in rows),
            log=True,
        )
        r = ratio_ci(ratios)
        loads = [v[cfg]["load"] for v in rows]
        where = {
            "offline": "offline generate()",
            "b1": "server, 1 bucket (8 rows always)",
            "b4": "server, buckets 1,2,4,8",
        }[cfg.split("/")[1]]
        lines.append(
            f"| {m.upper()} | {where} | {tpot:.1f} | {ttft:.0f} | {r[0]:.2f}x [{r[1]:.2f}, {r[2]:.2f}] | {min(loads):.1f}-{max(loads):.1f} |"
        )
    return "\n".join(lines)


def probe_args(report_fn, new_tokens: int) -> argparse.ArgumentParser | None:
    """The serving probes' shared command line: ``--report FILE...`` prints ``report_fn``'s tables (and
    gives None); otherwise a parser with the shared flags, to which the probe adds its own."""
    if sys.argv[1:2] == ["--report"]:
        print("\n\n".join(report_fn(p) for p in sys.argv[2:]))
        return None
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--methods", nargs="+", default=["ar", "sd"])
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=new_tokens)
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    from serve_helpers import start, stop

    if (ap := probe_args(report, 64)) is None:
        return
    a = ap.parse_args()
    servers: dict = {}
    try:
        for m in a.methods:
            for buckets in (1, 4):
                flags = [
                    "--served-model-name",
                    "served",
                    "--max-batch",
                    str(a.max_batch),
                    "--batch-buckets",
                    str(buckets),
                ]
                flags += [] if m == "ar" else ["--method", m, "--draft", a.draft]
                servers[f"{m}/b{buckets}"] = start(a.target, *flags, timeout=1800)
        _measure(a, servers)
    finally:
        for proc, _ in servers.values():
            stop(proc)


def _measure(a, servers: dict) -> None:
    from ssd_jax import SamplingParams, SpecConfig, generate, load_model
    from ssd_jax.data.prompts import load_prompts

    model, draft = load_model(a.target), load_model(a.draft)
    specs = {m: SpecConfig() if m == "ar" else SpecConfig(method=m, draft=draft) for m in a.methods}
    sp = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    prompts = [r["prompt"] for c in ("code", "chat") for r in load_prompts(c, n=8)]
    configs = [*servers, *(f"{m}/offline" for m in a.methods)]

    def once(cfg: str, prompt: str) -> dict:
        m, where = cfg.split("/")
        if where == "offline":
            r = generate(model, [prompt], sp, specs[m], chat=True).metrics
            return {"ttft_s": r["ttft_s"], "tpot_s": r["tpot_s"], "tokens": r["generated_tokens"]}
        return stream_tpot(servers[cfg][1], prompt, a.new_tokens)

    for cfg in configs:  # warm-up: compile what the first call compiles, untimed
        once(cfg, prompts[0])
    rng, calls = random.Random(0), []
    for rep in range(a.repeats):
        for i, p in enumerate(prompts):
            for cfg in rng.sample(configs, len(configs)):
                calls.append(
                    {"config": cfg, "prompt": i, "repeat": rep, "load": os.getloadavg()[0], **once(cfg, p)}
                )
        print(f"repeat {rep + 1}/{a.repeats} done", file=sys.stderr, flush=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump(
                {"target": a.target, "max_batch": a.max_batch, "new_tokens": a.new_tokens, "calls": calls}, f
            )
        os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
