"""Requests that share a long system prompt, with and without prefix caching (the paged cache's).

    python experiments/probes/serve_prefix.py --target smollm2-135m-instruct --out FILE.json
    python experiments/probes/serve_prefix.py --report FILE.json     # the table (markdown)

Starts one server per (method, prefix caching on / off), all at once (an idle server waits, it does not
spin). Every request is a streamed greedy completion whose prompt is the same ``--system-tokens``-token
text followed by a distinct question (the code and chat prompt sets, 8 each), ``--new-tokens`` tokens
(``ignore_eos``), one request at a time. Per repeat and question every configuration runs once, in a
shuffled order. TTFT is the first streamed token's arrival; TPOT (last - first) / (tokens - 1). The JSON
holds every call, the servers' prefix-cache counters and the load.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))


def stream(url: str, prompt: str, new: int) -> dict:
    import httpx

    body = {"model": "served", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0, stamps, tokens = time.perf_counter(), [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if any(c.get("text") for c in ch.get("choices") or []):
                stamps.append(time.perf_counter())
            if ch.get("usage"):
                tokens = ch["usage"]["completion_tokens"]
    return {
        "ttft_s": stamps[0] - t0,
        "tpot_s": (stamps[-1] - stamps[0]) / max(1, tokens - 1),
        "tokens": tokens,
    }


def report(path: str) -> str:
    """Per method: TTFT and TPOT with caching on and off (means), and the TTFT ratio off / on, paired per
    (question, repeat), the 95% t-interval over questions."""
    from collections import defaultdict

    from ssd_jax.bench.stats import clustered, mean_ci, ratio_ci

    d = json.load(open(path))
    by = defaultdict(dict)
    for c in d["calls"]:
        by[(c["prompt"], c["repeat"])][c["config"]] = c
    lines = [
        f"{d['target']}, {d['system_tokens']}-token shared prompt, {d['new_tokens']} tokens, one request at a time",
        "",
        "| method | prefix caching | TTFT ms | TPOT ms | TTFT without / with | hits / queries (tokens) | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in d["methods"]:
        for on in ("on", "off"):
            cfg = f"{m}/{on}"
            rows = [v for v in by.values() if f"{m}/on" in v and f"{m}/off" in v]
            ttft = mean_ci([v[cfg]["ttft_s"] * 1e3 for v in rows])[0]
            tpot = mean_ci([v[cfg]["tpot_s"] * 1e3 for v in rows])[0]
            ratio = ""
            if on == "on":
                r = ratio_ci(
                    clustered(
                        (
                            (k[0], v[f"{m}/off"]["ttft_s"] / v[cfg]["ttft_s"])
                            for k, v in by.items()
                            if v in rows
                        ),
                        log=True,
                    )
                )
                ratio = f"{r[0]:.2f}x [{r[1]:.2f}, {r[2]:.2f}]"
            c = d["counters"][cfg]
            loads = [v[cfg]["load"] for v in rows]
            lines.append(
                f"| {m.upper()} | {on} | {ttft:.0f} | {tpot:.1f} | {ratio} | {c['hits']:.0f} / {c['queries']:.0f} "
                f"| {min(loads):.1f}-{max(loads):.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    from serve_alone import probe_args
    from serve_helpers import metrics, start, stop

    if (ap := probe_args(report, 16)) is None:
        return
    ap.add_argument("--system-tokens", type=int, default=512)
    a = ap.parse_args()
    from ssd_jax import load_model
    from ssd_jax.bench.serving import system_prompt
    from ssd_jax.data.prompts import load_prompts

    tok = load_model(a.target).tokenizer
    system = system_prompt(tok, a.system_tokens)
    questions = [r["prompt"] for c in ("code", "chat") for r in load_prompts(c, n=8)]
    servers: dict = {}
    try:
        for m in a.methods:
            for on in ("on", "off"):
                flags = ["--served-model-name", "served", "--max-batch", str(a.max_batch)]
                flags += [] if on == "on" else ["--no-prefix-caching"]
                flags += [] if m == "ar" else ["--method", m, "--draft", a.draft]
                servers[f"{m}/{on}"] = start(a.target, *flags, timeout=1800)
        # warm-up: the first call compiles; it also caches the system prompt
        for _, url in servers.values():
            stream(url, system + "\n\n" + questions[0], a.new_tokens)
        rng, calls = random.Random(0), []
        for rep in range(a.repeats):
            for i, q in enumerate(questions):
                order = list(servers)
                rng.shuffle(order)
                for cfg in order:
                    r = stream(servers[cfg][1], system + "\n\n" + q, a.new_tokens)
                    calls.append({"config": cfg, "prompt": i, "repeat": rep, "load": os.getloadavg()[0], **r})
        counters = {}
        for cfg, (_, url) in servers.items():
            m = metrics(url)
            counters[cfg] = {
                "queries": m.get("ssd_jax:prefix_cache_queries_total", 0.0),
                "hits": m.get("ssd_jax:prefix_cache_hits_total", 0.0),
            }
    finally:
        for proc, _ in servers.values():
            stop(proc)
    out = {
        "target": a.target, "draft": a.draft, "methods": a.methods, "max_batch": a.max_batch,
        "new_tokens": a.new_tokens, "system_tokens": a.system_tokens, "system_chars": len(system),
        "calls": calls, "counters": counters,
    }  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(out, f)
    print(report(a.out))


if __name__ == "__main__":
    main()
