import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time, numpy as np, jax, ssd_jax
from ssd_jax.parallel.placement import cache_for, put_on
from ssd_jax.loading.loaded import with_weight_dtype
from ssd_jax.drafters.vocab import trimmed_draft
from ssd_jax.drafters.model import _draft_steps
from ssd_jax.sampling.filters import SamplingParams, RowSampling
d = trimmed_draft(with_weight_dtype(ssd_jax.load_model("qwen2.5-coder-0.5b-instruct"), "bfloat16"), 32768, None)
B, L, K = 16, 300, 2
put = lambda x: put_on(d, x)
rs = RowSampling.broadcast(SamplingParams(), B)
_, prop = _draft_steps(d.cfg, K, 151936, False)
tok = put(np.full((B,), 100, np.int32))
key = jax.random.PRNGKey(0)
for c in (False, True):
    cache = cache_for(d, B, 512).with_lengths(put(np.full((B,), L, np.int32)))
    ts = []
    for i in range(6):
        t = time.perf_counter()
        toks, q, cache = prop[c](d.params, cache, tok, tok, key, rs)
        jax.block_until_ready((toks, q)); ts.append(time.perf_counter() - t)
        cache = cache.with_lengths(put(np.full((B,), L, np.int32)))
    print(f"catch_up={c} K={K} B={B}: median {np.median(ts[2:])*1e3:.0f} ms, q {None if q is None else q.shape}", flush=True)
