"""Plain autoregressive decoding: one compiled step per token, step t+1 queued on the device
before step t's tokens are read, so the device never waits on the host's EOS / stop checks.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from ssd_jax.decoding import runtime
from ssd_jax.decoding.batch import GenerationResult, RowState, eos_ids, plan_batch, speed_metrics
from ssd_jax.parallel.placement import cache_for, put_on
from ssd_jax.sampling.filters import RowSampling


def generate_ar(model, prompts, ids, sampling, spec, on_text) -> GenerationResult:
    rows_prompt = [p for p in prompts for _ in range(sampling.n)]
    rows_ids = [x for x in ids for _ in range(sampling.n)]
    B = len(rows_ids)
    width, max_len = plan_batch(model, rows_ids, sampling, spec)
    eos = eos_ids(model)
    rows = [RowState(p, i, model, sampling, eos) for p, i in zip(rows_prompt, rows_ids)]

    tokens = np.zeros((B, width), np.int32)
    for b, r in enumerate(rows_ids):
        tokens[b, : len(r)] = r
    n_valid = np.array([len(r) for r in rows_ids], np.int32)
    rs = RowSampling.broadcast(sampling, B)
    rs = jax.tree.map(lambda x: put_on(model, x), rs)
    key = put_on(model, jax.random.key_data(jax.random.key(sampling.seed)))
    key = jax.random.wrap_key_data(key)
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

    metrics = speed_metrics(rows, wall, ttft, compile_s, n_valid)
    metrics["steps"] = step
    return GenerationResult([r.output() for r in rows], metrics, method="ar")

