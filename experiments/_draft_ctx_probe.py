import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time, functools, numpy as np, jax, ssd_jax
from ssd_jax.decoding.sd import sd_steps
from ssd_jax.parallel.placement import cache_for, put_on
from ssd_jax.loading.loaded import with_weight_dtype
from ssd_jax.drafters.vocab import trimmed_draft
d = trimmed_draft(with_weight_dtype(ssd_jax.load_model("qwen2.5-coder-0.5b-instruct"), "bfloat16"), 32768, None)
put = functools.partial(put_on, d)
score, _ = sd_steps(d.cfg, False)
none = put(np.zeros((16, 0), np.int32))
tok = put(np.full((16,), 100, np.int32))
for B in (16,):
    for max_len, L in ((64, 16), (512, 16), (512, 300), (512, 480)):
        cache = cache_for(d, B, max_len)
        cache = cache.with_lengths(put(np.full((B,), L, np.int32)))
        ts = []
        for i in range(8):
            t = time.perf_counter(); lg, cache = score(d.params, cache, tok, none); lg.block_until_ready(); ts.append(time.perf_counter() - t); cache = cache.with_lengths(put(np.full((B,), L, np.int32)))
        print(f"B={B} max_len={max_len} len={L}: median {np.median(ts[2:])*1e3:.1f} ms", flush=True)
