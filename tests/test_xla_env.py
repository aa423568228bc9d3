"""The XLA settings applied on ``import ssd_jax`` (``ssd_jax.xla_env``): the memory-minimising CPU
scheduler, so that a forward pass with narrow (bfloat16) weights does not hold every layer's
widened weights at once, and the rules for when the flag is (not) added."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ssd_jax import xla_env

PROBE = """
import ssd_jax, jax, jax.numpy as jnp
def chain(x, ws):  # the shape of a prefill through bfloat16 weights: widen, then the dot
    for w in ws:
        x = x @ w.astype(jnp.float32).T
    return x
x = jnp.ones((64, 256), jnp.float32)
ws = [jnp.ones((256, 256), jnp.bfloat16) for _ in range(12)]
temp = jax.jit(chain).lower(x, ws).compile().memory_analysis().temp_size_in_bytes
print(ssd_jax.xla_env.MEMORY_SCHEDULER, temp)
"""
WIDENED = 256 * 256 * 4  # one widened matrix


def _probe(**env):
    # this process's import of ssd_jax added the flag to XLA_FLAGS: start the child without it
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if xla_env.SCHEDULER_FLAG not in f)
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "XLA_FLAGS": flags, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(sys.platform != "linux", reason="the probe reads XLA's CPU buffer assignment")
def test_import_keeps_widened_weights_from_piling_up():
    on, temp_on = _probe()
    assert on, "import ssd_jax did not select the memory-minimising CPU scheduler"
    assert temp_on < 4 * WIDENED, f"temporaries {temp_on} B: the widened weights are live at once"
    off, temp_off = _probe(SSD_JAX_XLA_DEFAULTS="0")
    assert not off
    if temp_off <= temp_on:
        pytest.skip(f"this XLA's default scheduler no longer piles them up ({temp_off} B); the flag may go")
    assert temp_off >= 12 * WIDENED  # why the flag is there: every widened weight at once


def test_apply_leaves_user_flags_and_opt_out_alone(monkeypatch):
    monkeypatch.setattr(xla_env, "_backend_started", lambda: False)
    monkeypatch.setattr(xla_env, "_xla_knows", lambda flag: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert xla_env.apply()
    assert (
        os.environ["XLA_FLAGS"]
        == f"--xla_force_host_platform_device_count=2 --{xla_env.SCHEDULER_FLAG}=false"
    )
    monkeypatch.setenv("XLA_FLAGS", f"--{xla_env.SCHEDULER_FLAG}=true")  # the user's choice stands
    assert not xla_env.apply() and os.environ["XLA_FLAGS"] == f"--{xla_env.SCHEDULER_FLAG}=true"
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv("SSD_JAX_XLA_DEFAULTS", "0")
    assert not xla_env.apply() and "XLA_FLAGS" not in os.environ


def test_apply_adds_nothing_it_cannot_honour(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("SSD_JAX_XLA_DEFAULTS", raising=False)
    monkeypatch.setattr(xla_env, "_backend_started", lambda: False)
    monkeypatch.setattr(xla_env, "_xla_knows", lambda flag: False)  # an XLA without it would abort on it
    assert not xla_env.apply() and "XLA_FLAGS" not in os.environ
    monkeypatch.setattr(xla_env, "_xla_knows", lambda flag: True)
    monkeypatch.setattr(xla_env, "_backend_started", lambda: True)  # too late: XLA has read its flags
    assert not xla_env.apply() and "XLA_FLAGS" not in os.environ


def test_the_installed_xla_knows_the_flag():
    assert xla_env._xla_knows(xla_env.SCHEDULER_FLAG)
    assert not xla_env._xla_knows("xla_cpu_no_such_flag_anywhere_0451")
