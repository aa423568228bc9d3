"""Plain autoregressive decoding: one compiled step per token, step t+1 queued on the device
before step t's tokens are read, so the device never waits on the host's EOS / stop checks.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from ssd_jax.decoding import runtime
from ssd_jax.decoding.batch import Batch, GenerationResult, seed_key
from ssd_jax.parallel.placement import cache_for, put_on
from ssd_jax.sampling.filters import RowSampling


def generate_ar(model, prompts, ids, sampling, spec, on_text) -> GenerationResult:
    batch = Batch.build(model, prompts, ids, sampling, spec)
    rows, B, n_valid, max_len = batch.rows, batch.size, batch.n_valid, batch.max_len
    tokens = batch.tokens
    rs = jax.tree.map(lambda x: put_on(model, x), RowSampling.broadcast(sampling, B))
    key = seed_key(sampling.seed, lambda x: put_on(model, x))
    prefill, decode = runtime.ar_steps(model.cfg, sampling.needs_filter)

    cache = cache_for(model, B, max_len)
    tokens_d, n_valid_d = put_on(model, tokens), put_on(model, n_valid)
    compile_s = prefill.precompile(model.params, cache, tokens_d, n_valid_d, key, rs)
    first_tok_spec = put_on(model, np.zeros((B,), np.int32))
    step0 = put_on(model, np.int32(0))
    compile_s += decode.precompile(model.params, cache, first_tok_spec, key, step0, rs)

    t0 = time.perf_counter()
    tok_d, cache = prefill(model.params, cache, tokens_d, n_valid_d, key, rs)
    pending = tok_d
    ttft = None
    step = 0
    while True:
        # queue the next step before looking at this one (the device never idles on the host)
        step += 1
        nxt = None
        if step < sampling.max_new_tokens:
            nxt, cache = decode(model.params, cache, pending, key, put_on(model, np.int32(step)), rs)
        host = np.asarray(pending)
        if ttft is None:
            ttft = time.perf_counter() - t0
        for b, r in enumerate(rows):
            new = r.push(int(host[b]))
            if new and on_text is not None:
                on_text(b, new)
        if all(r.done for r in rows) or nxt is None:
            break
        pending = nxt
    wall = time.perf_counter() - t0
    if nxt is not None:
        nxt.block_until_ready()  # don't leave a step running into the next call's timing

    metrics = batch.speed_metrics(wall, ttft, compile_s)
    metrics["steps"] = step
    return GenerationResult(batch.outputs(), metrics, method="ar")
