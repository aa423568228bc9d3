"""The CLIs' persistent compilation cache (``ssd_jax.compile.use_persistent_cache``, called by
``ssd_jax.errors.cli_main``): a second process with the same XLA flags loads its programs from the
cache, one with a changed flag compiles them again, ``SSD_JAX_COMPILE_CACHE=0`` turns it off, and the
folder is keyed by the host CPU (JAX's own key does not name it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ssd_jax import compile as compile_mod

# a tiny CLI run through cli_main: one jitted program; prints the cache folder, the persistent-cache
# hits JAX reported and the folder's entries
SCRIPT = """
import json, sys
from ssd_jax.errors import cli_main

def run(argv):
    import jax, jax.numpy as jnp
    from jax._src import monitoring

    hits = []
    monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    )
    jax.jit(lambda x: jnp.tanh(x) * 3 - 1)(jnp.arange(5.0)).block_until_ready()
    d = jax.config.jax_compilation_cache_dir
    print(json.dumps(dict(dir=d, hits=len(hits), enabled=jax.config.jax_enable_compilation_cache)))
    return 0

sys.exit(cli_main(run))
"""
EXTRA_FLAG = "--xla_cpu_enable_fast_math=false"  # XLA:CPU's default: changes the key, not the program


def _run(env_extra: dict, xla_extra: str = "") -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "SSD_JAX_COMPILE_CACHE"))
    }
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=1 {xla_extra}".strip()
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _entries(d) -> set[str]:
    return {p for p in os.listdir(d) if p.endswith("-cache")} if os.path.isdir(d) else set()


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The first run into an empty cache folder: (its report, the folder, the entries it wrote)."""
    base = tmp_path_factory.mktemp("jit")
    out = _run({"SSD_JAX_COMPILE_CACHE": str(base)})
    return out, base, _entries(out["dir"])


def test_first_run_fills_a_cpu_keyed_folder(first):
    out, base, entries = first
    assert out["hits"] == 0 and out["enabled"]
    assert os.path.dirname(out["dir"]) == str(base)
    assert os.path.basename(out["dir"]).startswith("jax-")
    assert any(e.startswith("jit__lambda-") for e in entries), entries  # every program, however small


def test_same_flags_hit(first):
    out, base, entries = first
    again = _run({"SSD_JAX_COMPILE_CACHE": str(base)})
    assert again["dir"] == out["dir"]
    assert again["hits"] >= 1
    assert _entries(out["dir"]) == entries  # nothing compiled again


def test_changed_xla_flag_misses(first):
    out, base, entries = first
    other = _run({"SSD_JAX_COMPILE_CACHE": str(base)}, xla_extra=EXTRA_FLAG)
    assert other["dir"] == out["dir"]
    assert other["hits"] == 0
    new = _entries(out["dir"]) - entries
    assert any(e.startswith("jit__lambda-") for e in new), new  # compiled and stored under a new key


def test_off_switch(tmp_path):
    jax_dir = tmp_path / "jax-dir"
    out = _run({"SSD_JAX_COMPILE_CACHE": "0", "JAX_COMPILATION_CACHE_DIR": str(jax_dir)})
    assert not out["enabled"] and out["hits"] == 0
    assert _entries(jax_dir) == set()


def test_jax_compilation_cache_dir_is_kept(tmp_path):
    jax_dir = tmp_path / "jax-dir"
    out = _run({"JAX_COMPILATION_CACHE_DIR": str(jax_dir)})
    assert out["dir"] == str(jax_dir)
    assert any(e.startswith("jit__lambda-") for e in _entries(jax_dir))


def test_folder_is_keyed_by_the_cpu_and_defaults_to_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_mod.CACHE_ENV, raising=False)
    monkeypatch.setenv("SSD_JAX_CACHE", str(tmp_path))
    here = compile_mod.persistent_cache_dir()
    assert here.parent == tmp_path / "jit"
    monkeypatch.setattr(compile_mod, "cpu_tag", lambda: "model name\t: another CPU\nflags\t\t: sse2")
    assert compile_mod.persistent_cache_dir() != here
    monkeypatch.setenv(compile_mod.CACHE_ENV, "off")
    assert compile_mod.persistent_cache_dir() is None
