"""Do the target's verify and the draft's build slow each other down when they run on separate
cores at the same time? (SSD's premise: the draft has hardware of its own.)

    .venv/bin/python experiments/probes/contention.py [--target T] [--draft D] [--seconds S]

Starts the probe's own two children, pinned to core 0 (the target: a verify of K + 1 tokens at
batch 1, in a loop) and core 1 (the draft, bfloat16 with a 32,768-token head: one step at the
build's row count, or with ``--draft-work build`` SSD's whole cache build, in a loop), first each
alone, then both at once, and prints one JSON object:
each side's median seconds alone and together, and the slowdown."""

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import numpy as np
import ssd_jax
from ssd_jax.decoding.sd import sd_steps
from ssd_jax.drafters.vocab import load_with_head, trimmed_draft
from ssd_jax.loading.loaded import with_weight_dtype
from ssd_jax.parallel.placement import cache_for, put_on
role, name, rows, toks, seconds, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
if role == "target":
    m = ssd_jax.load_model(name)
else:
    m = with_weight_dtype(trimmed_draft(name, 32768, load_with_head), "bfloat16")
score, _ = sd_steps(m.cfg, False)
cache = cache_for(m, rows, 256).with_lengths(np.full(rows, 64, np.int32))
cur, spec = put_on(m, np.zeros(rows, np.int32)), put_on(m, np.zeros((rows, toks - 1), np.int32))
if role == "build":  # SSD's whole cache build: K = toks, M = rows branches, one row
    import functools, jax
    from ssd_jax.decoding.ssd import tree
    K, M = toks, rows
    opts = tree.Opts(k=K, budget=M, vocab=m.cfg.vocab_size, rand_vocab=m.cfg.vocab_size,
                     needs_filter=False, greedy=True, c=1.0, tree_base=128, mesh=None)
    cache = cache_for(m, 1, 256).with_lengths(np.full(1, 64, np.int32))
    kb = put_on(m, (np.arange(M) % (K + 1))[None].astype(np.int32))
    rb = put_on(m, (np.arange(M) // (K + 1))[None].astype(np.int32))
    args = (put_on(m, np.zeros(1, np.int32)), put_on(m, np.ones((1, K), np.int32)),
            put_on(m, np.full(1, K, np.int32)), kb, rb, put_on(m, np.ones((1, K), np.int32)), jax.random.key(0))
    build = jax.jit(functools.partial(tree.build_tree, rs=None, cfg=m.cfg, opts=opts), donate_argnums=(1,))
    def score(params, cache, cur, spec):
        tr, cache = build(params, cache, *args)
        return tr.tokens, cache
    rows = 1
for _ in range(2):
    lg, cache = score(m.params, cache, cur, spec)
    lg.block_until_ready()
    cache = cache.with_lengths(np.full(rows, 64, np.int32))
print("ready", flush=True)
while not __import__("os").path.exists(go):
    time.sleep(0.01)
ts, end = [], time.perf_counter() + seconds
while time.perf_counter() < end:
    a = time.perf_counter()
    lg, cache = score(m.params, cache, cur, spec)
    lg.block_until_ready()
    cache = cache.with_lengths(np.full(rows, 64, np.int32))
    ts.append(time.perf_counter() - a)
print(json.dumps({"median_s": float(np.median(ts)), "n": len(ts)}), flush=True)
"""


def run(jobs, seconds):
    go = f"/tmp/.contention-go-{os.getpid()}"
    if os.path.exists(go):
        os.remove(go)
    procs = []
    for role, name, cpu, rows, toks in jobs:
        env = {**os.environ, "SSD_JAX_CPUS": str(cpu)}
        args = [sys.executable, "-c", CHILD, role, name, str(rows), str(toks), str(seconds), go]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True))
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    open(go, "w").close()
    out = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.wait()
    os.remove(go)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--k", type=int, default=3, help="the verify scores K + 1 tokens")
    ap.add_argument("--rows", type=int, default=4, help="the draft step's rows (the build's M)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument(
        "--draft-work",
        choices=("step", "build"),
        default="step",
        help="the draft side: one step at --rows rows, or SSD's cache build (K = --k, M = --rows)",
    )
    a = ap.parse_args()
    t = ("target", a.target, 0, 1, a.k + 1)
    d = ("draft", a.draft, 1, a.rows, 1) if a.draft_work == "step" else ("build", a.draft, 1, a.rows, a.k)
    res = {"load_1min": os.getloadavg()[0], "config": vars(a)}
    res["target_alone_s"] = run([t], a.seconds)[0]["median_s"]
    res["draft_alone_s"] = run([d], a.seconds)[0]["median_s"]
    both = run([t, d], a.seconds)
    res["target_together_s"], res["draft_together_s"] = both[0]["median_s"], both[1]["median_s"]
    res["target_slowdown"] = res["target_together_s"] / res["target_alone_s"]
    res["draft_slowdown"] = res["draft_together_s"] / res["draft_alone_s"]
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
