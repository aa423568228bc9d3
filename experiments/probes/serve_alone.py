"""One request at a time in an 8-slot server, with and without batch buckets, against offline batch 1.

    python experiments/probes/serve_alone.py --target smollm2-135m-instruct --out FILE.json

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


def main() -> None:
    from serve_helpers import start, stop

    from ssd_jax import SamplingParams, SpecConfig, generate, load_model
    from ssd_jax.data.prompts import load_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--methods", nargs="+", default=["ar", "sd"])
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    servers = {}
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
            flags += [] if m == "ar" else ["--method", m]
            servers[f"{m}/b{buckets}"] = start(a.target, *flags, timeout=1800)
    model = load_model(a.target)
    specs = {m: SpecConfig() if m == "ar" else SpecConfig(method=m) for m in a.methods}
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
    try:
        for rep in range(a.repeats):
            for i, p in enumerate(prompts):
                for cfg in rng.sample(configs, len(configs)):
                    calls.append(
                        {
                            "config": cfg,
                            "prompt": i,
                            "repeat": rep,
                            "load": os.getloadavg()[0],
                            **once(cfg, p),
                        }
                    )
            print(f"repeat {rep + 1}/{a.repeats} done", file=sys.stderr, flush=True)
            with open(a.out + ".tmp", "w") as f:
                json.dump(
                    {
                        "target": a.target,
                        "max_batch": a.max_batch,
                        "new_tokens": a.new_tokens,
                        "calls": calls,
                    },
                    f,
                )
            os.replace(a.out + ".tmp", a.out)
    finally:
        for proc, _ in servers.values():
            stop(proc)


if __name__ == "__main__":
    main()
