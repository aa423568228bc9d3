"""The paged KV cache (``llama.init_paged_cache``): a pool of blocks and a block table per row. The CPU
kernel reads through the table as the gathered reference does; a model run over a paged cache, with
its blocks scattered over the pool and shared between rows, gives the logits of the contiguous cache;
batch buckets, row prefills and windows are views of the table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sd import tiny_model

from ssd_jax.models import kernels, llama


def _pool_case(B, T, KVH, G, hd, N, bs, P, S, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, KVH, G, hd), np.float32))
    k = jnp.asarray(rng.standard_normal((N, bs, KVH, hd), np.float32))
    v = jnp.asarray(rng.standard_normal((N, bs, KVH, hd), np.float32))
    pages = jnp.asarray(rng.integers(0, N, (B, P)), jnp.int32)
    mask = jnp.asarray(rng.random((B, T, S)) < 0.6)
    return q, k, v, pages, mask


@pytest.mark.skipif(kernels.compiler() is None or not kernels.enabled(), reason="no CPU kernels")
@pytest.mark.parametrize(
    "B,T,KVH,G,hd,N,bs,P,S", [(3, 1, 2, 3, 32, 9, 4, 5, 18), (2, 5, 1, 4, 24, 6, 8, 3, 24)]
)
def test_paged_kernel_reads_through_the_block_table(B, T, KVH, G, hd, N, bs, P, S):
    q, k, v, pages, mask = _pool_case(B, T, KVH, G, hd, N, bs, P, S, seed=B + T)
    got = jax.jit(lambda *a: kernels.paged_attention(*a, 0.3))(q, k, v, pages, mask)
    want = kernels.attention_reference(
        q, kernels.paged_read(k, pages, S), kernels.paged_read(v, pages, S), mask, 0.3
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6 * float(jnp.abs(want).max()))


def _paged_like(cfg, B, max_len, bs, rng):
    """A paged cache whose rows' blocks are scattered over a pool larger than needed."""
    per_row = -(-max_len // bs)
    n = B * per_row + 5
    cache = llama.init_paged_cache(cfg, B, max_len, n, bs)
    table = rng.permutation(n)[: B * per_row].reshape(B, per_row).astype(np.int32)
    return llama.KVCache(cache.k, cache.v, cache.lengths, None, jnp.asarray(table))


def test_a_paged_cache_gives_the_contiguous_logits():
    """Prefill then decode steps over a paged cache (blocks scattered; a 1-row bucket and a window as
    views) equal the contiguous cache's logits."""
    model = tiny_model(0)
    cfg, params = model.cfg, model.params
    rng = np.random.default_rng(0)
    B, L, bs = 2, 40, 8
    prompt = jnp.asarray(rng.integers(2, 128, (B, 11)), jnp.int32)
    flat = llama.init_cache(cfg, B, L)
    paged = _paged_like(cfg, B, L, bs, rng)
    step = jax.jit(lambda c, t: llama.forward(params, cfg, t, c))
    outs = []
    for cache in (flat, paged):
        h, cache = step(cache, prompt)
        cache = cache.with_lengths(cache.lengths + prompt.shape[1])
        hs = [h]
        tok = jnp.argmax(llama.logits(params, cfg, h[:, -1:]), -1).astype(jnp.int32)
        for _ in range(6):
            h, cache = step(cache, tok)
            cache = cache.with_lengths(cache.lengths + 1)
            hs.append(h)
            tok = jnp.argmax(llama.logits(params, cfg, h), -1).astype(jnp.int32)
        # a 1-row bucket with a 24-slot window: row 0 alone
        part = llama.bucket_view(cache, 1).with_window(24)
        h1, _ = jax.jit(lambda c, t: llama.forward(params, cfg, t, c))(part, tok[:1])
        hs.append(h1)
        outs.append(hs)
    for a, b in zip(*outs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_a_row_without_blocks_writes_nothing():
    """A free row (every table entry empty) runs along in a batch: its writes are dropped, so the pool
    holds exactly what the other rows wrote."""
    model = tiny_model(0)
    cfg, params = model.cfg, model.params
    rng = np.random.default_rng(1)
    base = _paged_like(cfg, 2, 32, 8, rng)
    n = base.k[0].shape[0]
    empty = jnp.full((1, base.pages.shape[1]), n, jnp.int32)
    wide = llama.KVCache(base.k, base.v, jnp.zeros(3, jnp.int32), None, jnp.concatenate([base.pages, empty]))
    toks = jnp.asarray(rng.integers(2, 128, (3, 5)), jnp.int32)
    _, a = llama.forward(params, cfg, toks[:2], base)
    _, b = llama.forward(params, cfg, toks, wide)
    for x, y in zip(a.k + a.v, b.k + b.v):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(jnp.abs(a.k[0]).sum()) > 0  # the two rows did write
