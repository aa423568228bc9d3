"""Does the paged pool hold every slot's whole context, and does a workload that overflows it complete?

    python experiments/probes/serve_capacity.py --out experiments/results/serving/capacity_smollm2.json

Two servers, one after the other: 8 slots of ``--max-model-len`` 2048 with the default pool (every slot's
whole context) and with ``--kv-blocks`` holding fewer tokens than 8 full sequences. Each gets 8 concurrent
greedy completions whose prompts fill the context (distinct from their first block on, so no block is
shared) and ``--new-tokens`` tokens each (``ignore_eos``). Recorded per server: every request's completion
tokens and status, the wall time, ``ssd_jax:num_preemptions`` and the prefix-cache counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))


async def _complete(url: str, prompt: str, new: int) -> dict:
    import httpx

    body = {"model": "served", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=3600) as c:
        r = await c.post(url + "/v1/completions", json=body)
    d = r.json()
    return {"status": r.status_code, "tokens": (d.get("usage") or {}).get("completion_tokens"),
            "prompt_tokens": (d.get("usage") or {}).get("prompt_tokens")}  # fmt: skip


async def _all(url: str, prompts: list[str], new: int) -> list[dict]:
    return list(await asyncio.gather(*(_complete(url, p, new) for p in prompts)))


def main() -> None:
    from serve_helpers import metrics, start, stop

    from ssd_jax import load_model
    from ssd_jax.data.prompts import load_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="ar")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--overflow-blocks", type=int, default=512, help="the small pool (16-slot blocks)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tok = load_model(a.target).tokenizer
    n_prompt = a.max_model_len - a.new_tokens - 64  # room for the method's extra slots
    ids = tok.encode("\n\n".join(r["prompt"] for r in load_prompts("chat", n=1000)))
    if len(ids) < 8 * n_prompt:
        raise SystemExit(f"the chat prompts hold {len(ids)} tokens, fewer than 8 x {n_prompt}")
    prompts = [tok.decode(ids[i * n_prompt : (i + 1) * n_prompt]) for i in range(8)]  # 8 distinct texts
    runs = []
    for label, extra in (("default pool", []), ("small pool", ["--kv-blocks", str(a.overflow_blocks)])):
        flags = ["--served-model-name", "served", "--max-batch", "8", "--max-model-len", str(a.max_model_len)]
        flags += ["--method", a.method, *extra]
        proc, url = start(a.target, *flags, timeout=1800)
        try:
            t0 = time.perf_counter()
            reqs = asyncio.run(_all(url, prompts, a.new_tokens))
            wall = time.perf_counter() - t0
            m = metrics(url)
        finally:
            stop(proc)
        runs.append({
            "pool": label, "flags": extra, "wall_s": wall, "requests": reqs, "loadavg": os.getloadavg()[0],
            "preemptions": m.get("ssd_jax:num_preemptions_total", 0.0),
            "prefix_queries": m.get("ssd_jax:prefix_cache_queries_total", 0.0),
            "prefix_hits": m.get("ssd_jax:prefix_cache_hits_total", 0.0),
        })  # fmt: skip
        r = runs[-1]
        done = sum(q["status"] == 200 and q["tokens"] == a.new_tokens for q in reqs)
        print(f"{label}: {done}/8 complete, {r['preemptions']:.0f} preemptions, {wall:.1f} s, "
              f"prompt tokens {[q['prompt_tokens'] for q in reqs]}", flush=True)  # fmt: skip
    out = {"target": a.target, "method": a.method, "max_model_len": a.max_model_len, "new_tokens": a.new_tokens,
           "runs": runs}  # fmt: skip
    with open(a.out + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
