"""The CPU matmul kernel (ssd_jax.models.kernels, through the XLA FFI): it equals XLA's dot for
every row count it takes, under jit, scan, cond, vmap and grad; the "kernel" matmul form gives
the same model outputs and greedy SD tokens as the einsum; sharded weights and the off switch
fall back to the einsum. Skipped where no C++ compiler is installed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ssd_jax.models import forms as F
from ssd_jax.models import kernels, llama

pytestmark = pytest.mark.skipif(
    kernels.compiler() is None or not kernels.enabled(), reason="no C++ compiler (or SSD_JAX_KERNELS=off)"
)

KERNEL = F.Forms(**{r: F.Form("oi", ("kernel", "kernel", "right")) for r in F.ROLES})


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _close(a, b, rel=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert np.max(np.abs(a - b)) <= rel * np.max(np.abs(b)), np.max(np.abs(a - b)) / np.max(np.abs(b))


def test_kernel_builds_and_registers():
    assert kernels.available()
    assert kernels.build().exists()


def test_build_id_is_the_loaded_build_and_costs_no_subprocess(monkeypatch):
    want = kernels.build().parent.name
    import subprocess

    def refuse(*a, **k):
        raise AssertionError("build_id() ran a subprocess")

    monkeypatch.setattr(subprocess, "run", refuse)  # asked on every generate() with K auto
    assert kernels.build_id() == want
    monkeypatch.setenv(kernels.ENV, "off")
    kernels.available.cache_clear()
    try:
        assert kernels.build_id() == "off"
    finally:
        monkeypatch.undo()
        kernels.available.cache_clear()
    assert kernels.build_id() == want


@pytest.mark.parametrize("m", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(40, 64), (130, 576), (7, 33), (1024, 200)])
def test_kernel_equals_einsum(m, n, k):
    x, w = _rand((m, k), m), _rand((n, k), n + k)
    assert kernels.usable(x, w)
    _close(jax.jit(kernels.rows_matmul)(x, w), x @ w.T)


@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("n,k", [(40, 64), (130, 576), (7, 33)])
def test_bf16_weight_kernel_equals_the_widened_einsum(m, n, k):
    """bfloat16 weights, float32 rows: the kernel widens W exactly (bf16 -> f32 is lossless), so it
    matches the float32 dot of the widened matrix to float32 rounding."""
    x, w = _rand((m, k), m), _rand((n, k), n + k).astype(jnp.bfloat16)
    assert kernels.usable(x, w)
    y = jax.jit(kernels.rows_matmul)(x, w)
    assert y.dtype == jnp.float32
    _close(y, x @ w.astype(jnp.float32).T)


def test_narrow_weights_go_to_the_kernel_at_every_order_and_widen_beyond_it():
    """``forms.contract`` with bfloat16 weights under float32 rows (a ``--draft-dtype bfloat16`` draft):
    the kernel at 1..MAX_ROWS rows whatever the form's order (XLA:CPU's mixed dot is 10-20x slower),
    the widened einsum at more rows (prefill) and where the kernel cannot run."""
    w = _rand((48, 64), 1).astype(jnp.bfloat16)
    ref_w = w.astype(jnp.float32)
    for rows in (1, 5, 16, 40):
        x = _rand((rows, 64), rows)
        for order in ("right", "kernel"):
            f = jax.jit(lambda x, w, order=order: F.contract(x, w, "oi", order))
            hlo = f.lower(x, w).as_text()
            assert (kernels.TARGET_BF16 in hlo) == (rows <= kernels.MAX_ROWS), (rows, order)
            _close(f(x, w), x @ ref_w.T)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    ws = jax.device_put(w, NamedSharding(mesh, P("tp", None)))
    x = _rand((5, 64), 0)
    f = jax.jit(lambda x, w: F.contract(x, w, "oi", "kernel"))
    assert kernels.TARGET_BF16 not in f.lower(x, ws).as_text()
    _close(f(x, ws), x @ ref_w.T)


def test_kernel_under_scan_cond_vmap_grad_and_batch_dims():
    x, w = _rand((2, 3, 64), 0), _rand((48, 64), 1)
    ref = x @ w.T
    _close(jax.jit(kernels.rows_matmul)(x, w), ref)
    ys = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c, kernels.rows_matmul(c, w)), x, None, length=3)[1])(x)
    _close(ys, jnp.broadcast_to(ref, ys.shape))
    y = jax.jit(lambda p, x: jax.lax.cond(p, lambda: kernels.rows_matmul(x, w), lambda: -(x @ w.T)))(True, x)
    _close(y, ref)
    _close(jax.vmap(kernels.rows_matmul, in_axes=(0, None))(x, w), ref)
    g = jax.grad(lambda x, w: jnp.sum(kernels.rows_matmul(x, w) ** 2), argnums=(0, 1))(x, w)
    g_ref = jax.grad(lambda x, w: jnp.sum((x @ w.T) ** 2), argnums=(0, 1))(x, w)
    for a, b in zip(g, g_ref):
        _close(a, b)


def test_kernel_form_falls_back_where_it_cannot_run():
    w = _rand((48, 64), 1)
    assert not kernels.usable(_rand((17, 64), 0), w)  # more rows than MAX_ROWS
    assert not kernels.usable(_rand((5, 64), 0).astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    ws = jax.device_put(w, NamedSharding(mesh, P("tp", None)))
    x = _rand((5, 64), 0)
    assert not kernels.usable(x, ws)
    seen = []
    jax.jit(lambda x, w: seen.append(kernels.usable(x, w)) or x)(x, ws)
    assert seen == [False]  # decided at trace time from the operand's mesh
    _close(jax.jit(lambda x, w: F.contract(x, w, "oi", "kernel"))(x, ws), x @ w.T)
    hlo = jax.jit(lambda x, w: F.contract(x, w, "oi", "kernel")).lower(x, ws).as_text()
    assert kernels.TARGET not in hlo
    assert kernels.TARGET in jax.jit(lambda x, w: F.contract(x, w, "oi", "kernel")).lower(x, w).as_text()
    with pytest.raises(ValueError):
        F.Form("io", ("right", "kernel", "right"))


def _tiny():
    from test_sd import tiny_model

    return tiny_model(0)


@pytest.mark.parametrize("t", [1, 5])
def test_kernel_forms_match_the_einsum_in_the_model(t):
    m = _tiny()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, t)), jnp.int32)

    def run(cfg):
        cache = llama.init_cache(cfg, 2, 32)
        h, _ = jax.jit(llama.forward, static_argnums=1)(m.params, cfg, tokens, cache)
        return np.asarray(jax.jit(llama.logits, static_argnums=1)(m.params, cfg, h))

    assert (
        kernels.TARGET
        in jax.jit(llama.forward, static_argnums=1)
        .lower(m.params, m.cfg.replace(forms=KERNEL), tokens, llama.init_cache(m.cfg, 2, 32))
        .as_text()
    )
    _close(run(m.cfg.replace(forms=KERNEL)), run(m.cfg), rel=1e-5)


def test_greedy_sd_equals_ar_with_the_kernel(pair, ar_ref):
    from test_sd import PROMPTS, _ids

    from ssd_jax import SamplingParams, SpecConfig, generate

    target, draft = (dataclasses.replace(x, cfg=x.cfg.replace(forms=KERNEL)) for x in pair)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert _ids(generate(target, PROMPTS, sp)) == ar_ref
    res = generate(target, PROMPTS[:2], sp, SpecConfig(method="sd", draft=draft, k=4))  # 2 x 5 rows: kernel
    assert _ids(res) == ar_ref[:2]


def test_off_switch_gives_the_einsum(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "off")
    kernels.available.cache_clear()
    try:
        assert not kernels.available()
        x, w = _rand((5, 64), 0), _rand((48, 64), 1)
        hlo = jax.jit(lambda x, w: F.contract(x, w, "oi", "kernel")).lower(x, w).as_text()
        assert kernels.TARGET not in hlo
        np.testing.assert_array_equal(
            np.asarray(jax.jit(lambda x, w: F.contract(x, w, "oi", "kernel"))(x, w)),
            np.asarray(jax.jit(lambda x, w: F.contract(x, w, "oi", "right"))(x, w)),
        )
        m = _tiny()  # the whole model: the kernel forms traced with the switch off = the einsum forms
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, m.cfg.vocab_size, (1, 5)), jnp.int32)

        def run(cfg):  # a fresh function: nothing traced with the kernel on is reused
            return np.asarray(
                jax.jit(
                    lambda p, t: llama.logits(
                        p, cfg, llama.forward(p, cfg, t, llama.init_cache(cfg, 1, 16))[0]
                    )
                )(m.params, tokens)
            )

        np.testing.assert_array_equal(run(m.cfg.replace(forms=KERNEL)), run(m.cfg))
    finally:
        monkeypatch.delenv(kernels.ENV)
        kernels.available.cache_clear()
    assert kernels.available()


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    kernels.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="unavailable"):
            assert not kernels.available()
        assert not kernels.usable(_rand((5, 64), 0), _rand((48, 64), 1))
    finally:
        monkeypatch.undo()
        kernels.available.cache_clear()
    assert kernels.available()


def test_programs_lowered_for_accelerators_never_contain_the_call():
    x, w = _rand((5, 64), 0), _rand((48, 64), 1)
    f = jax.jit(lambda x, w: F.contract(x, w, "oi", "kernel"))
    for platforms in (("cuda",), ("tpu",)):
        text = f.trace(x, w).lower(lowering_platforms=platforms).as_text()
        assert kernels.TARGET not in text and "dot_general" in text


@pytest.mark.parametrize("isa", kernels.runnable_isas())
def test_every_build_equals_the_dot_at_every_row_count(isa):
    """Each build this machine can run (native; avx2, which reproduces an AVX2-only CPU on an AVX-512 one;
    portable) equals XLA's float32 dot at M = 1..16 rows, with K not a multiple of any vector width and W
    in float32 or bfloat16; and it targets what it is named for."""
    v = kernels.variant(isa)
    if isa == "avx2":
        assert v.said.startswith("avx2 lanes=8 regs=16")
    if isa == "native" and "avx512f" in kernels.cpu_flags():
        assert v.said.startswith("avx512")
    for n, k in ((37, 83), (130, 200)):
        xs = [_rand((m, k), m) for m in range(1, 17)]
        for dtype in (jnp.float32, jnp.bfloat16):
            w = _rand((n, k), n + k).astype(dtype)
            ys = jax.jit(lambda xs, w: [v.rows_matmul(x, w) for x in xs])(xs, w)
            for x, y in zip(xs, ys):
                _close(y, x @ w.astype(jnp.float32).T)


def test_the_build_is_chosen_by_name_and_checked(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="SSD_JAX_KERNEL_ISA"):
        kernels.isa_wanted()
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert kernels.isa_wanted() == "avx2"
    # a build that does not target what its name promises is refused (flags that did not reach the compiler)
    with pytest.raises(RuntimeError, match="avx2 build targets"):
        kernels._check_isa("avx2", "generic lanes=4 regs=16 rows=2x5")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    with pytest.raises(RuntimeError, match="native build targets"):
        kernels._check_isa("native", "avx2 lanes=8 regs=16 rows=2x5")
    kernels._check_isa("native", "avx512 lanes=16 regs=32 rows=3x8")
    assert kernels.isa().split(":")[0] in kernels.ISAS
