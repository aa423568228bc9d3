"""What the benchmark suites and the sweeps share: the environment record and draft loading."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def environment() -> dict:
    """JAX version, backend, devices, cores, Python, git commit, load average, the CPU kernels' build and
    the XLA flags in effect (``XLA_FLAGS``; ``cpu_memory_scheduler``: see :mod:`ssd_jax.xla_env`): stored
    with every result."""
    import jax

    from ssd_jax import xla_env

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    dev = jax.devices()[0]
    kernels_build = "off"
    if jax.default_backend() == "cpu":
        from ssd_jax.models import kernels

        kernels_build = kernels.isa()  # the CPU kernels' build and what it targets (issue 54)
    return {
        "kernels": kernels_build,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "git_commit": commit,
        "loadavg": os.getloadavg(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpu_memory_scheduler": xla_env.MEMORY_SCHEDULER,
    }


def load_draft(name: str, target):
    """A draft by name/path, or ``first-N-layers``: the target's own first N layers (a shared-vocabulary draft)."""
    import ssd_jax
    from ssd_jax.engine.methods.eagle import is_eagle

    if is_eagle(name):  # an EAGLE head: the engine loads it beside the target
        return name
    if name.startswith("first-") and name.endswith("-layers"):
        n = int(name.split("-")[1])
        return dataclasses.replace(
            target,
            name=f"{target.name}-first-{n}-layers",
            cfg=target.cfg.replace(num_layers=n),
            params={**target.params, "layers": target.params["layers"][:n]},
        )
    return ssd_jax.load_model(name)


def saguaro_plot(p: Path, rows: list[dict[str, Any]], plt) -> Path | None:
    """An SSD sweep's cache hit rate against acceptance, one point per Saguaro C (None: < 2 Cs)."""
    pts = [r for r in rows if r["config"]["method"] == "ssd" and "cache_hit_rate" in r]
    if len({r["config"]["saguaro_c"] for r in pts}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(5, 4))
    for r in pts:
        ax.scatter(r["acceptance_rate"], r["cache_hit_rate"], color="C0")
        ax.annotate(f"C={r['config']['saguaro_c']}", (r["acceptance_rate"], r["cache_hit_rate"]), fontsize=8)
    ax.set_xlabel("acceptance rate")
    ax.set_ylabel("cache hit rate")
    ax.set_title(f"{p.stem}: Saguaro C trades acceptance for hits")
    fig.tight_layout()
    out = p.with_name(p.stem + "_hit_vs_acceptance.png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
