"""Seconds per EAGLE-head training step for a target, with the shipped recipe's shapes.

    python experiments/probes/eagle_step_time.py --target qwen2.5-coder-1.5b-instruct \
        --out experiments/results/eagle/step_time_qwen.json

One jitted step (``ssd_jax.drafters.eagle.make_head_step``: the frozen target over the batch, the head
unrolled ``--depth`` steps, KL over the kept tokens, AdamW) on random token windows of the recipe's
shape (4 x 256, depth 4, LM head 8,192 tokens), timed after one compiling call: the median of
``--steps`` calls. What a training run of N steps costs on this machine is about N times it.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import jax
    import numpy as np
    import optax

    from ssd_jax import load_model
    from ssd_jax.drafters import eagle
    from ssd_jax.training.eagle_train import head_vocab_ids

    target = load_model(a.target, dtype="float32")
    spec = eagle.HeadSpec(eagle.default_layers(target.cfg.num_layers))
    head = eagle.init_head(target.cfg, spec)
    opt = optax.adamw(1e-4)
    state = opt.init(head)
    step = eagle.make_head_step(target.cfg, spec, a.depth, opt)
    ids = jax.numpy.asarray(head_vocab_ids(target, a.vocab))
    rng = np.random.default_rng(0)
    toks = jax.numpy.asarray(rng.integers(0, 30000, (a.batch, a.seq_len)), jax.numpy.int32)
    w = jax.numpy.ones((a.batch, a.seq_len), jax.numpy.float32)
    t0 = time.perf_counter()
    head, state, loss, _ = step(head, state, target.params, toks, w, ids)
    loss.block_until_ready()
    first = time.perf_counter() - t0
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        head, state, loss, _ = step(head, state, target.params, toks, w, ids)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
    out = {"target": a.target, "batch": a.batch, "seq_len": a.seq_len, "depth": a.depth, "vocab": a.vocab,
           "head_params": eagle.count_head_params(head), "first_call_s": first, "step_s": times,
           "median_step_s": float(np.median(times)), "load": os.getloadavg()[0]}  # fmt: skip
    from ssd_jax.loading.draft import write_json_atomic

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    write_json_atomic(a.out, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
