"""Round cost against the live rows, SSD and AR (and SD), in the server's 8-slot engine (every sampling mode compiled,
batch buckets, a paged pool for AR/SD): 1, 2 and 4 chat prompts admitted together, 48 greedy tokens each, twice.

    python experiments/probes/serve_rows.py ar ssd [sd]
"""

import sys
import time
import ssd_jax
from ssd_jax import SamplingParams, SpecConfig
from ssd_jax.engine.core import Engine, Sequence, ALL_MODES
from ssd_jax.engine.methods import build_method
from ssd_jax.data.prompts import load_prompts

t = ssd_jax.load_model("smollm2-135m-instruct")
d = ssd_jax.load_model("smollm2-135m-draft")
specs = {
    "ssd": SpecConfig(
        method="ssd", draft=d, k=1, backup="auto", fan_out_budget=2, draft_dtype=None, draft_vocab=None
    ),
    "ar": SpecConfig(),
    "sd": SpecConfig(method="sd", draft=d, k=1, draft_dtype=None, draft_vocab=None),
}
sp = SamplingParams(max_new_tokens=48, ignore_eos=True)
tok = t.tokenizer
ps = [
    tok.encode(
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True),
        add_special_tokens=False,
    )
    for r in load_prompts("chat", n=8)
]
for name in sys.argv[1:]:
    m = build_method(t, specs[name], ALL_MODES, lambda n: d)
    e = Engine(
        m,
        max_batch=8,
        max_len=1024,
        prefill_chunk=64,
        admit_together=False,
        batch_buckets=4,
        kv_blocks=512,
        block_size=16,
        prefix_caching=False,
    )
    for rows in (1, 2, 4, 1, 2, 4):
        seqs = [Sequence(p, sp) for p in ps[:rows]]
        e.submit(seqs)
        e.admit()
        while e.waiting:
            e.step()
        r0, t0 = e.rounds, time.perf_counter()
        e.run()
        dt = time.perf_counter() - t0
        print(
            f"{name} rows={rows}: {1e3 * dt / (e.rounds - r0):.1f} ms/round, {1e3 * dt / (rows * 47):.1f} ms per row-token",
            flush=True,
        )
