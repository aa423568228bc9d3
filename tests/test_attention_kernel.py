"""The CPU attention kernel (``kernels.attention``, attention.cc through the XLA FFI): it equals the
einsum reference for decode / verify / tree shapes (grouped heads, odd head sizes, arbitrary masks,
rows that see nothing), under jit, vmap and grad; the model routes float32 blocks of at most
``ATTENTION_MAX_T`` tokens on one device to it and everything else (prefill blocks, bfloat16
caches, sharded operands, accelerator lowering, the off switch) to the einsums. Skipped where no
C++ compiler is installed."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ssd_jax.models import kernels, llama

pytestmark = pytest.mark.skipif(
    kernels.compiler() is None or not kernels.enabled(), reason="no C++ compiler (or SSD_JAX_KERNELS=off)"
)


def _case(B, T, KVH, G, hd, S, seed, p_visible=0.5):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, KVH, G, hd), np.float32))
    k = jnp.asarray(rng.standard_normal((B, S, KVH, hd), np.float32))
    v = jnp.asarray(rng.standard_normal((B, S, KVH, hd), np.float32))
    mask = rng.random((B, T, S)) < p_visible
    return q, k, v, jnp.asarray(mask)


def _close(a, b, tol=2e-6):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b))), np.max(np.abs(a - b))


@pytest.mark.parametrize(
    "B,T,KVH,G,hd,S",
    [
        (1, 1, 2, 6, 128, 512),  # Qwen 1.5B decode
        (1, 9, 2, 7, 64, 200),  # Qwen 0.5B, a K = 8 verify
        (3, 5, 3, 3, 64, 96),  # SmolLM2-like heads, a batch
        (2, 4, 1, 1, 24, 37),  # head size not a multiple of 16, one head
        (2, 16, 2, 2, 16, 20),  # a 16-token tree block
    ],
)
def test_attention_kernel_equals_the_reference(B, T, KVH, G, hd, S):
    q, k, v, mask = _case(B, T, KVH, G, hd, S, seed=B * 100 + T)
    scale = 1 / math.sqrt(hd)
    assert kernels.attention_usable(q, k, v)
    got = jax.jit(lambda *a: kernels.attention(*a, scale))(q, k, v, mask)
    _close(got, kernels.attention_reference(q, k, v, mask, scale))


def test_causal_prefix_masks_and_rows_that_see_nothing():
    """The model's masks: each query sees a prefix of the cache (rows of different lengths); a row
    that sees no slot gets the reference's answer (the mean of all values), not NaN."""
    B, T, S = 3, 4, 50
    q, k, v, _ = _case(B, T, 2, 3, 32, S, seed=7)
    slots = jnp.asarray([[5, 6, 7, 8], [30, 31, 32, 33], [0, 1, 2, 3]], jnp.int32)
    mask = llama.causal_slot_mask(slots, S).at[2, 0].set(False)  # row 2, query 0: blind
    got = jax.jit(lambda *a: kernels.attention(*a, 0.3))(q, k, v, mask)
    assert np.isfinite(np.asarray(got)).all()
    _close(got, kernels.attention_reference(q, k, v, mask, 0.3))
    _close(got[2, 0], jnp.broadcast_to(v[2].mean(0)[:, None, :], got[2, 0].shape), tol=1e-5)


def test_tree_masks_with_unseen_chunks_between_prefix_and_tree_region():
    """An SSD tree step's mask: each branch sees its row's prefix and its own few slots in the tree region
    past the cache's end, nothing between. The kernel skips the 16-slot chunks no query row sees; the
    result is the reference's (rows of different prefixes, a chunk boundary inside the prefix, a blind row)."""
    B, M, K, S, base = 2, 6, 3, 160, 130  # tree region [base, base + M * K)
    q, k, v, _ = _case(B, M, 2, 2, 16, S, seed=11)
    slot = np.arange(S)
    prefix = np.array([37, 5])[:, None, None] > slot  # row 0: 37 slots (3 chunks), row 1: 5
    d = 1  # the second tree step: each branch sees its own first two slots
    own = (slot >= base + np.arange(M)[:, None] * K) & (slot <= base + np.arange(M)[:, None] * K + d)
    mask = prefix | own[None]
    mask[1, 2] = False  # a branch that sees nothing
    got = jax.jit(lambda *a: kernels.attention(*a, 0.25))(q, k, v, jnp.asarray(mask))
    _close(got, kernels.attention_reference(q, k, v, jnp.asarray(mask), 0.25))


def test_a_bucket_or_window_reads_the_first_rows_and_slots_of_the_whole_cache():
    """A batch bucket (q over the first rows) and an attention window (a mask narrower than the cache)
    hand the kernel the whole cache buffers; it attends over the first B rows and S slots only, as the
    reference over the slice does, including a blind row (the mean over the S window slots)."""
    B, T, S = 2, 3, 40
    q, _, _, mask = _case(B, T, 2, 3, 32, S, seed=11)
    _, k, v, _ = _case(5, T, 2, 3, 32, 96, seed=12)  # 5 slots' rows, 96 cache slots
    mask = mask.at[1, 2].set(False)
    scale = 0.25
    assert kernels.attention_usable(q, k, v)
    got = jax.jit(lambda *a: kernels.attention(*a, scale))(q, k, v, mask)
    _close(got, kernels.attention_reference(q, k[:B, :S], v[:B, :S], mask, scale))


def test_attention_kernel_under_vmap_and_grad():
    q, k, v, mask = _case(2, 3, 2, 2, 32, 24, seed=3)
    f = lambda q, k, v: kernels.attention(q, k, v, mask, 0.2)
    r = lambda q, k, v: kernels.attention_reference(q, k, v, mask, 0.2)
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
    for gk, gr in zip(
        jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v), jax.grad(loss(r), argnums=(0, 1, 2))(q, k, v)
    ):
        _close(gk, gr, tol=1e-5)
    qs = jnp.stack([q, q * 0.5])
    _close(jax.vmap(lambda q: f(q, k, v))(qs), jax.vmap(lambda q: r(q, k, v))(qs))


def _tiny():
    from test_sd import tiny_model

    return tiny_model(0)


def _forward_hlo(m, T, cache_dtype=None):
    tokens = jnp.zeros((2, T), jnp.int32)
    cache = llama.init_cache(m.cfg, 2, 80, dtype=cache_dtype)
    return jax.jit(llama.forward, static_argnums=1).lower(m.params, m.cfg, tokens, cache).as_text()


def test_the_model_routes_small_float32_blocks_to_the_kernel_only():
    m = _tiny()
    assert kernels.TARGET_ATTENTION in _forward_hlo(m, 1)
    assert kernels.TARGET_ATTENTION in _forward_hlo(m, kernels.ATTENTION_MAX_T)
    assert kernels.TARGET_ATTENTION not in _forward_hlo(m, kernels.ATTENTION_MAX_T + 1)  # prefill blocks
    assert kernels.TARGET_ATTENTION not in _forward_hlo(m, 1, cache_dtype=jnp.bfloat16)
    q, k, v, mask = _case(1, 2, 2, 2, 16, 8, seed=0)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    ks = jax.device_put(k, NamedSharding(mesh, P(None, None, "tp", None)))
    assert not kernels.attention_usable(q, ks, v)
    f = jax.jit(lambda q, k, v, m: kernels.attention(q, k, v, m, 0.5))
    assert kernels.TARGET_ATTENTION not in f.lower(q, ks, v, mask).as_text()
    for platforms in (("cuda",), ("tpu",)):
        text = f.trace(q, k, v, mask).lower(lowering_platforms=platforms).as_text()
        assert kernels.TARGET_ATTENTION not in text and "dot_general" in text


@pytest.mark.parametrize("T", [1, 6])
def test_model_logits_with_the_kernel_match_the_einsums(T, monkeypatch):
    m = _tiny()
    rng = np.random.default_rng(T)
    tokens = jnp.asarray(rng.integers(0, m.cfg.vocab_size, (2, T)), jnp.int32)
    cache = llama.init_cache(m.cfg, 2, 40).with_lengths(jnp.asarray([3, 11], jnp.int32))

    def run():  # a fresh function each time: traced under the current routing
        return np.asarray(
            jax.jit(lambda p, t, c: llama.logits(p, m.cfg, llama.forward(p, m.cfg, t, c)[0]))(
                m.params, tokens, cache
            )
        )

    with_kernel = run()
    monkeypatch.setattr(kernels, "attention_usable", lambda *a: False)
    _close(with_kernel, run(), tol=1e-5)


@pytest.mark.parametrize("isa", kernels.runnable_isas())
def test_every_build_equals_the_reference_at_every_t(isa):
    """Each build this machine can run (the avx2 one reproduces an AVX2-only CPU) at T = 1..16 new tokens,
    with random masks (rows that see nothing included), grouped heads and a head size that is no multiple
    of any vector width: the register tiles' short edges and both score paths (dot-product trees for a few
    query rows, keys transposed in registers for many)."""
    v = kernels.variant(isa)
    for T in range(1, 17):
        q, k, val, mask = _case(2, T, 2, 3, 40 if T % 2 else 64, 45, seed=T, p_visible=0.6)
        mask = mask.at[1, 0].set(False)  # a row that sees nothing
        got = jax.jit(lambda *a: v.attention(*a, 0.125))(q, k, val, mask)
        _close(got, kernels.attention_reference(q, k, val, mask, 0.125))
