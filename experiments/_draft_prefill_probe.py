import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time, numpy as np, jax, ssd_jax
from ssd_jax.parallel.placement import cache_for, put_on
from ssd_jax.loading.loaded import with_weight_dtype
from ssd_jax.drafters.vocab import trimmed_draft
from ssd_jax.drafters.model import _draft_steps
from ssd_jax.decoding.batch import encode_prompts
from ssd_jax.bench import protocol
d = trimmed_draft(with_weight_dtype(ssd_jax.load_model("qwen2.5-coder-0.5b-instruct"), "bfloat16"), 32768, None)
ids = encode_prompts(d, [r["prompt"] for r in protocol.category_prompts("code", 16)], chat=True)
lens = [len(i) for i in ids]; T = max(lens)
print("prompt lengths", sorted(lens), "T", T, flush=True)
toks = np.zeros((16, T), np.int32)
for i, x in enumerate(ids): toks[i, :len(x)] = x
pre, _ = _draft_steps(d.cfg, 2, 151936, False)
put = lambda x: put_on(d, x)
for rep in range(3):
    cache = cache_for(d, 16, T + 64)
    t = time.perf_counter()
    cache = pre(d.params, cache, put(toks), put(np.array(lens, np.int32)))
    jax.block_until_ready(cache.k); print(f"draft prefill B=16 T={T}: {time.perf_counter()-t:.2f} s", flush=True)
