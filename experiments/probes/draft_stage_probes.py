"""Probes (anecdotes) of the Qwen 0.5B draft (bfloat16, 32,768-token head) at batch 16, for
experiments/results/qwen_b16_stages.md:

    python experiments/probes/draft_stage_probes.py prefill   # the draft prefill of 16 chat-templated code prompts
    python experiments/probes/draft_stage_probes.py propose   # the compiled K = 2 proposal, without / with catch-up
    python experiments/probes/draft_stage_probes.py context   # a one-token forward at several context lengths
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import numpy as np

import ssd_jax
from ssd_jax.drafters.model import _draft_steps
from ssd_jax.drafters.vocab import trimmed_draft
from ssd_jax.loading.loaded import with_weight_dtype
from ssd_jax.parallel.placement import cache_for, put_on

B, TARGET_VOCAB = 16, 151936


def median_ms(run, n, skip):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t)
    return np.median(ts[skip:]) * 1e3


def prefill(d, put):
    from ssd_jax.bench import protocol
    from ssd_jax.decoding.batch import encode_prompts

    ids = encode_prompts(d, [r["prompt"] for r in protocol.category_prompts("code", B)], chat=True)
    lens = [len(i) for i in ids]
    T = max(lens)
    print("prompt lengths", sorted(lens), "T", T, flush=True)
    toks = np.zeros((B, T), np.int32)
    for i, x in enumerate(ids):
        toks[i, : len(x)] = x
    pre, _ = _draft_steps(d.cfg, 2, TARGET_VOCAB, False)
    run = lambda: jax.block_until_ready(
        pre(d.params, cache_for(d, B, T + 64), put(toks), put(np.array(lens, np.int32))).k
    )
    for _ in range(3):
        print(f"draft prefill B={B} T={T}: {median_ms(run, 1, 0) / 1e3:.2f} s", flush=True)


def propose(d, put, L=300, K=2):
    from ssd_jax.sampling.filters import RowSampling, SamplingParams

    rs = RowSampling.broadcast(SamplingParams(), B)
    _, prop = _draft_steps(d.cfg, K, TARGET_VOCAB, False)
    tok, key = put(np.full((B,), 100, np.int32)), jax.random.PRNGKey(0)
    for c in (False, True):
        state = {"cache": cache_for(d, B, 512)}

        def run(state=state, c=c):
            cache = state["cache"].with_lengths(put(np.full((B,), L, np.int32)))
            toks, q, state["cache"] = prop[c](d.params, cache, tok, tok, key, rs)
            jax.block_until_ready((toks, q))

        print(f"catch_up={c} K={K} B={B}: median {median_ms(run, 6, 2):.0f} ms", flush=True)


def context(d, put):
    from ssd_jax.decoding.sd import sd_steps

    score, _ = sd_steps(d.cfg, False)
    none, tok = put(np.zeros((B, 0), np.int32)), put(np.full((B,), 100, np.int32))
    for max_len, L in ((64, 16), (512, 16), (512, 300), (512, 480)):
        state = {"cache": cache_for(d, B, max_len)}

        def run(state=state, L=L):
            cache = state["cache"].with_lengths(put(np.full((B,), L, np.int32)))
            lg, state["cache"] = score(d.params, cache, tok, none)
            lg.block_until_ready()

        print(f"B={B} max_len={max_len} len={L}: median {median_ms(run, 8, 2):.1f} ms", flush=True)


if __name__ == "__main__":
    probe = {"prefill": prefill, "propose": propose, "context": context}[
        sys.argv[1] if len(sys.argv) > 1 else "prefill"
    ]
    d = trimmed_draft(
        with_weight_dtype(ssd_jax.load_model("qwen2.5-coder-0.5b-instruct"), "bfloat16"), 32768, None
    )
    probe(d, lambda x: put_on(d, x))
