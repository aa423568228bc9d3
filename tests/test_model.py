"""Logit parity with Hugging Face transformers (CPU torch) and cache/sharding invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ssd_jax
from ssd_jax.models import llama
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import init_params

ATOL = 1e-4

# jitted once per config (op-by-op eager dispatch is far slower than one compile)
_fwd = jax.jit(llama.forward, static_argnums=(1,))
_logits = jax.jit(llama.logits, static_argnums=(1,))


def _ref_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def test_hf_parity_prefill_and_cached_decode(tiny_hf):
    kind, path, ref_model = tiny_hf
    m = ssd_jax.load_model(path, dtype="float32")
    ids = np.random.RandomState(0).randint(0, m.cfg.vocab_size, (3, 24))
    ref = _ref_logits(ref_model, ids)

    cache = llama.init_cache(m.cfg, 3, 64)
    h, cache = _fwd(m.params, m.cfg, jnp.asarray(ids[:, :16]), cache)
    cache = cache.with_lengths(cache.lengths + 16)
    pre = np.asarray(_logits(m.params, m.cfg, h))
    assert np.abs(pre - ref[:, :16]).max() <= ATOL, kind

    for t in range(16, 24):  # cached one-token decode
        h, cache = _fwd(m.params, m.cfg, jnp.asarray(ids[:, t : t + 1]), cache)
        cache = cache.with_lengths(cache.lengths + 1)
        got = np.asarray(_logits(m.params, m.cfg, h[:, 0]))
        assert np.abs(got - ref[:, t]).max() <= ATOL, (kind, t)


def test_config_flags_follow_family(tiny_hf):
    kind, path, _ = tiny_hf
    cfg = ssd_jax.load_model(path, dtype="float32").cfg
    assert cfg.qkv_bias == (kind == "qwen2")
    assert cfg.tie_embeddings == (kind != "qwen2")
    assert (cfg.rope_scaling is not None) == (kind == "llama3")


def _tiny_cfg(**kw):
    base = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        max_position_embeddings=256,
        qkv_bias=True,
    )
    base.update(kw)
    return ModelConfig(**base)


def test_cache_path_matches_full_forward_and_ragged_offsets():
    cfg = _tiny_cfg()
    params = init_params(cfg, 0, scale=0.2)
    ids = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 20)), jnp.int32)
    full, _ = _fwd(params, cfg, ids, llama.init_cache(cfg, 2, 32))
    full = _logits(params, cfg, full)

    # rows at different offsets: row 0 prefilled with 5 tokens, row 1 with 11, then chunks of 3
    cache = llama.init_cache(cfg, 2, 32)
    lens = np.array([5, 11])
    pad = np.zeros((2, 11), np.int32)
    pad[0, :5], pad[1, :11] = ids[0, :5], ids[1, :11]
    _, cache = _fwd(params, cfg, jnp.asarray(pad), cache)
    cache = cache.with_lengths(jnp.asarray(lens))
    for _ in range(3):
        chunk = np.stack([np.asarray(ids[b, lens[b] : lens[b] + 3]) for b in range(2)])
        h, cache = _fwd(params, cfg, jnp.asarray(chunk), cache)
        got = np.asarray(_logits(params, cfg, h))
        for b in range(2):
            np.testing.assert_allclose(got[b], np.asarray(full[b, lens[b] : lens[b] + 3]), atol=1e-5)
        lens = lens + 3
        cache = cache.with_lengths(jnp.asarray(lens))


def test_rollback_is_resetting_the_length():
    """Writing rejected tokens and then resetting the length leaves no trace of them."""
    cfg = _tiny_cfg()
    params = init_params(cfg, 2, scale=0.2)
    ids = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, (1, 12)), jnp.int32)
    cache = llama.init_cache(cfg, 1, 32)
    _, cache = _fwd(params, cfg, ids[:, :8], cache)
    cache = cache.with_lengths(jnp.array([8]))
    junk = jnp.asarray(np.random.RandomState(4).randint(0, cfg.vocab_size, (1, 4)), jnp.int32)
    _, cache = _fwd(params, cfg, junk, cache)  # "verify" 4 tokens, reject all
    h, _ = _fwd(params, cfg, ids[:, 8:], cache)  # same length: overwrites the junk
    ref, _ = _fwd(params, cfg, ids, llama.init_cache(cfg, 1, 32))
    np.testing.assert_allclose(np.asarray(h), np.asarray(ref[:, 8:]), atol=1e-5)


def test_out_of_range_writes_are_dropped_not_clamped():
    cfg = _tiny_cfg(num_layers=1)
    params = init_params(cfg, 5, scale=0.2)
    cache = llama.init_cache(cfg, 1, 8)
    _, cache = _fwd(params, cfg, jnp.ones((1, 6), jnp.int32), cache)
    before = np.asarray(cache.k[0])
    _, cache2 = _fwd(params, cfg, jnp.full((1, 4), 7, jnp.int32), cache.with_lengths(jnp.array([6])))
    after = np.asarray(cache2.k[0])
    np.testing.assert_array_equal(after[0, :6], before[0, :6])  # slots 8, 9 were dropped, not wrapped


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_forward_equals_unsharded(tp):
    from ssd_jax.parallel.sharding import cache_sharding, make_mesh, shard_params

    cfg = _tiny_cfg(num_kv_heads=2)  # 2 KV heads: replicated on a 4/8-way mesh, sharded on 2
    params = init_params(cfg, 6, scale=0.2)
    ids = jnp.asarray(np.random.RandomState(7).randint(0, cfg.vocab_size, (2, 10)), jnp.int32)

    def run(p, cache):
        h, cache = _fwd(p, cfg, ids, cache)
        return _logits(p, cfg, h), cache

    ref, _ = jax.jit(run)(params, llama.init_cache(cfg, 2, 16))
    mesh = make_mesh(jax.devices()[:tp])
    sp = shard_params(cfg, params, mesh)
    assert len(sp["layers"][0]["wq"].sharding.device_set) == tp
    assert sp["layers"][0]["wq"].sharding.spec[0] == "tp"  # heads are split
    assert sp["layers"][0]["w_up"].sharding.spec[0] == "tp"  # MLP hidden is split
    sh = cache_sharding(cfg, mesh, 2, 16)
    c = llama.init_cache(cfg, 2, 16)
    c = llama.KVCache([jax.device_put(x, sh) for x in c.k], [jax.device_put(x, sh) for x in c.v], c.lengths)
    got, _ = jax.jit(run)(sp, c)
    assert got.sharding.device_set == set(jax.devices()[:tp])
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)
