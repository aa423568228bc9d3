"""Matmul forms (ssd_jax.models.forms): every storage layout and contraction order computes the
same forward pass, the loader applies the layout exactly once, and shardings follow it."""

import dataclasses
import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.loading import load_model, store
from ssd_jax.models import forms as F
from ssd_jax.models import llama
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import flatten, init_params, param_specs, to_layout, unflatten

IO_R, IO_L, OI_L = F.Form("io"), F.Form("io", ("left",) * 3), F.Form("oi", ("left",) * 3)
MIXED = F.Forms(
    q=F.Form("io", ("right", "left", "right")),
    k=IO_L,
    v=IO_L,
    o=IO_R,
    gate=IO_R,
    up=OI_L,
    down=F.Form("io", ("right", "left", "left")),
    head=IO_R,
)
CASES = {
    "all io right": F.Forms(**{r: IO_R for r in F.ROLES}),
    "all io left": F.Forms(**{r: IO_L for r in F.ROLES}),
    "all oi left": F.Forms(**{r: OI_L for r in F.ROLES}),
    "mixed": MIXED,
}


def _cfg(tie: bool, bias: bool) -> ModelConfig:
    return ModelConfig(
        arch="qwen2" if bias else "llama",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qkv_bias=bias,
        tie_embeddings=tie,
    )


def _relaid(cfg, params, forms):
    dst = cfg.replace(forms=forms)
    return dst, unflatten(dst, {n: to_layout(cfg, dst, n, w) for n, w in flatten(params).items()})


def _run(cfg, params, tokens, cache_len=32):
    cache = llama.init_cache(cfg, tokens.shape[0], cache_len)
    h, _ = jax.jit(llama.forward, static_argnums=1)(params, cfg, tokens, cache)
    return np.asarray(jax.jit(llama.logits, static_argnums=1)(params, cfg, h))


@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)])
@pytest.mark.parametrize("case", list(CASES))
def test_every_form_computes_the_reference_forward(case, tie, bias):
    cfg = _cfg(tie, bias)
    params = init_params(cfg, seed=1, scale=0.2)
    fcfg, fparams = _relaid(cfg, params, CASES[case])
    rng = np.random.default_rng(0)
    for B, T in ((1, 1), (1, 5), (2, 5), (1, 20)):  # decode, verify (K = 4), batched verify, prefill buckets
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
        np.testing.assert_allclose(
            _run(fcfg, fparams, tokens), _run(cfg, params, tokens), rtol=2e-5, atol=2e-5
        )


def test_layout_round_trip_and_shapes():
    cfg = _cfg(tie=True, bias=True)
    params = init_params(cfg, seed=2)
    fcfg, fparams = _relaid(cfg, params, MIXED)
    for n, (shape, _) in param_specs(fcfg).items():
        assert flatten(fparams)[n].shape == shape
    assert param_specs(fcfg)["layers.0.wq"][0] == (32, 4, 8)  # (D, H, hd): stored (in, out)
    assert param_specs(fcfg)["embed"][0] == (32, 96)  # tied: the embedding is the head
    back, bparams = _relaid(fcfg, fparams, F.CANONICAL)
    for n, w in flatten(params).items():
        np.testing.assert_array_equal(np.asarray(flatten(bparams)[n]), np.asarray(w))


def test_config_serialises_forms_and_omits_the_default():
    cfg = _cfg(tie=False, bias=False)
    assert "forms" not in cfg.to_dict()
    fcfg = cfg.replace(forms=MIXED)
    assert ModelConfig.from_dict(json.loads(json.dumps(fcfg.to_dict()))) == fcfg
    hash(fcfg)  # still a static jit argument


def test_backend_choice_keeps_accelerators_canonical(monkeypatch):
    cfg = _cfg(tie=False, bias=False)
    assert F.for_backend(cfg, "gpu") == F.CANONICAL and F.for_backend(cfg, "tpu") == F.CANONICAL
    assert F.resolve(cfg, "canonical") == F.CANONICAL
    monkeypatch.setenv("SSD_JAX_FORMS", "canonical")
    assert F.resolve(cfg) == F.CANONICAL
    table = {
        "q/o": [
            {"shape": [1536, 1536], "layout": "io", "orders": {"1": "right", "5": "left", "64": "right"}},
            {"shape": [32, 32], "layout": "oi", "orders": {"1": "left", "5": "left", "64": "right"}},
        ]
    }
    got = F.from_table(table, F.table_shapes(cfg))
    assert got.q == got.o == F.Form("oi", ("left", "left", "right"))  # the nearest measured shape decides
    assert got.down == F.Form()  # roles the table lacks keep the checkpoint form
    assert F.for_backend(cfg, "cpu") == F.from_table(F.load_table(), F.table_shapes(cfg))


def test_loading_applies_the_layout_once(tmp_path):
    cfg = _cfg(tie=False, bias=True)
    rng = np.random.default_rng(0)
    flat = {n: rng.standard_normal(s).astype(np.float32) for n, (s, _) in param_specs(cfg).items()}
    store.save_converted(tmp_path / "m", cfg, iter(dict(flat).items()), None, {"name": "m"})
    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())
    m = load_model(tmp_path / "m", forms=MIXED)
    live = sum(a.nbytes for a in jax.live_arrays()) - before
    leaves = jax.tree.leaves(m.params)
    assert m.cfg.forms == MIXED and len(leaves) == len(flat)
    assert live == sum(a.nbytes for a in flat.values()) == sum(x.nbytes for x in leaves)  # one copy of each
    fcfg = cfg.replace(forms=MIXED)
    for n, a in flatten(m.params).items():
        np.testing.assert_array_equal(np.asarray(a), to_layout(cfg, fcfg, n, flat[n]))
    assert m.params["layers"][0]["wq"].shape == (32, 4, 8) and m.params["layers"][0]["wk"].shape == (32, 2, 8)
    canon = load_model(tmp_path / "m", forms="canonical")
    tokens = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    np.testing.assert_allclose(
        _run(m.cfg, m.params, tokens), _run(canon.cfg, canon.params, tokens), rtol=2e-5, atol=2e-5
    )


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (fake) devices")
def test_sharding_follows_the_stored_layout():
    from ssd_jax.parallel.sharding import make_mesh, shard_params

    cfg = _cfg(tie=False, bias=True)
    params = init_params(cfg, seed=3, scale=0.2)
    fcfg, fparams = _relaid(cfg, params, CASES["all io right"])
    sp = shard_params(fcfg, fparams, make_mesh(jax.devices()[:4]))
    assert sp["layers"][0]["wq"].sharding.spec[:2] == (None, "tp")  # (D, H, hd): heads split
    assert sp["layers"][0]["w_down"].sharding.spec[0] == "tp"  # (F, D): MLP hidden split
    assert sp["lm_head"].sharding.spec[:2] == (None, "tp")  # (D, V): vocabulary split
    tokens = jnp.asarray([[5, 6, 7, 8, 9]], jnp.int32)
    np.testing.assert_allclose(_run(fcfg, sp, tokens), _run(cfg, params, tokens), rtol=2e-5, atol=2e-5)


def test_numpy_reference_reads_any_layout():
    from types import SimpleNamespace

    from reference import np_logits

    cfg = _cfg(tie=True, bias=True)
    params = init_params(cfg, seed=4, scale=0.2)
    fcfg, fparams = _relaid(cfg, params, MIXED)
    ids = [3, 1, 4, 1, 5]
    want = np_logits(SimpleNamespace(cfg=cfg, params=params), ids)
    np.testing.assert_allclose(np_logits(SimpleNamespace(cfg=fcfg, params=fparams), ids), want, rtol=1e-12)
    tokens = jnp.asarray([ids], jnp.int32)
    np.testing.assert_allclose(_run(fcfg, fparams, tokens)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tie", [False, True])
def test_trimmed_draft_head_follows_the_stored_layout(tie):
    """Vocabulary trimming slices the head in whatever layout it is stored: same logits either way."""
    from ssd_jax.drafters import vocab as dv
    from ssd_jax.loading.loaded import LoadedModel

    cfg = _cfg(tie, False)
    params = init_params(cfg, seed=3)
    io_cfg, io_params = _relaid(cfg, params, F.Forms(head=F.Form("io")))
    ids = np.array([0, 3, 5, 11], np.int32)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((2, cfg.hidden_size)), jnp.float32)
    out = []
    for c, p in ((cfg, params), (io_cfg, io_params)):
        m = LoadedModel(name="t", cfg=c, params=p, tokenizer=None, weights_sha256="", source="test")
        t = dv.trim_draft(m, ids)
        out.append(np.asarray(llama.logits(t.params, t.cfg, h)))
    np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-5)
    assert np.isneginf(out[1][:, 1]).all() and np.isfinite(out[1][:, ids]).all()


def _timed(per_row_cost):
    """A timing double: ``per_row_cost(form, M)`` seconds for every timed row count."""
    from ssd_jax.models import form_timing as T

    rows = (1, *T.VERIFY_ROWS)
    return lambda shape, dtype: {
        "shape": list(shape),
        "rows": {str(m): {c: per_row_cost(c, m) for c in T.CANDIDATES} for m in rows},
    }


def _big_cfg():
    return dataclasses.replace(_cfg(tie=False, bias=False), hidden_size=512, intermediate_size=1024, num_heads=8,
                               num_kv_heads=1, head_dim=64, vocab_size=1024)  # fmt: skip


def test_measured_forms_pick_xla_where_the_kernel_is_timed_slower(monkeypatch, tmp_path):
    """The shipped table says "kernel" for the verify bucket; a machine where the kernel is timed slower
    than XLA's dot (an AVX2 CPU with the old kernel: 5x one row at 5 rows) gets XLA's dot there, and a
    machine where it is faster keeps it. Only roles at least MIN_BYTES big are measured."""
    from ssd_jax.models import form_timing as T
    from ssd_jax.models import kernels

    monkeypatch.setenv("SSD_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("SSD_JAX_FORMS", raising=False)  # the suite runs with "table" (conftest.py)
    monkeypatch.setattr(kernels, "available", lambda: True)
    cfg = _big_cfg()
    prior = F.from_table(F.load_table(), F.table_shapes(cfg))
    assert prior.gate.orders[1] == "kernel"

    slow_kernel = _timed(lambda c, m: {"right": 1.0 + 0.5 * m, "left": 2.0 * m, "kernel": 1.6 * m}[c])
    got = T.refine(cfg, prior, timer=slow_kernel)
    measured = [
        r for t, s in F.table_shapes(cfg).items() if s[0] * s[1] * 4 >= T.MIN_BYTES for r in F.TABLE_ROLES[t]
    ]
    assert "gate" in measured and "k" not in measured  # 1024 x 512 measured, 64 x 512 not
    for role in F.ROLES:
        want = ("right", "right") if role in measured else getattr(prior, role).orders[:2]
        assert getattr(got, role).orders[:2] == want, role
        assert getattr(got, role).orders[2] == getattr(prior, role).orders[2]  # prefill: the table's

    fast_kernel = _timed(lambda c, m: {"right": 1.0 + 0.5 * m, "left": 2.0 * m, "kernel": 0.9 + 0.05 * m}[c])
    monkeypatch.setenv("SSD_JAX_CACHE", str(tmp_path / "other"))
    got = T.refine(cfg, prior, timer=fast_kernel)
    assert got.gate.orders[:2] == ("kernel", "kernel")
    tie = _timed(lambda c, m: {"right": 1.0, "left": 1.0, "kernel": 0.99}[c])  # within the margin: XLA
    assert T.choose(tie((512, 512), "float32")) == ("right", "right")


def test_measured_forms_are_cached_per_build_and_skipped_on_request(monkeypatch, tmp_path):
    from ssd_jax.models import form_timing as T
    from ssd_jax.models import kernels

    monkeypatch.setenv("SSD_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("SSD_JAX_FORMS", raising=False)  # the suite runs with "table" (conftest.py)
    monkeypatch.setattr(kernels, "available", lambda: True)
    calls = []

    def timer(shape, dtype):
        calls.append(shape)
        return _timed(lambda c, m: {"right": 1.0, "left": 2.0, "kernel": 0.5}[c])(shape, dtype)

    cfg = _big_cfg()
    prior = F.from_table(F.load_table(), F.table_shapes(cfg))
    first = T.refine(cfg, prior, timer=timer)
    n = len(calls)
    assert n and T.refine(cfg, prior, timer=timer) == first and len(calls) == n  # cached on disk
    monkeypatch.setattr(kernels, "build_id", lambda: "another-build")
    T.refine(cfg, prior, timer=timer)
    assert len(calls) == 2 * n  # a new build is measured again
    monkeypatch.setenv("SSD_JAX_FORMS", "table")
    assert T.refine(cfg, prior, timer=timer) == prior and len(calls) == 2 * n
    assert "verify kernel" in T.describe(first)
