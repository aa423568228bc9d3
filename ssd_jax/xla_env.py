"""XLA settings the project needs, applied when :mod:`ssd_jax` is imported.

XLA reads ``XLA_FLAGS`` once, when the first backend starts, so these take effect only if
``ssd_jax`` is imported before any JAX computation has run (``python -m ssd_jax...``, and any
script that imports ``ssd_jax`` first). A flag the user already set in ``XLA_FLAGS`` is left as
it is, and ``SSD_JAX_XLA_DEFAULTS=0`` turns all of this off.

``--xla_cpu_enable_concurrency_optimized_scheduler=false``: XLA:CPU's default scheduler starts
independent operations as early as possible, so that its runtime can overlap them. In a forward
pass whose weights are stored narrower than its activations (a ``--draft-dtype bfloat16``
draft outside the row kernel's range, e.g. its prefill), those operations are the weight
conversions of every layer, and all of them become live at once. The prefill of the trimmed
bfloat16 Qwen-0.5B draft held a 1.37 GB temporary buffer (25 MB with the memory-minimising
scheduler), which the OS faulted in afresh on every call: about 350k page faults and 2-3 s of
kernel time per generation, more when the machine's memory is short
(``experiments/results/cpu_scheduler.md``). The flag only concerns the CPU backend.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", None))
    except Exception:  # a jax without that internal: assume not started
        return False


def _xla_knows(flag: str) -> bool:
    """Whether the installed XLA defines ``flag``: XLA aborts the process on an unknown one."""
    try:
        import jaxlib
    except ImportError:
        return False
    libs = sorted(Path(jaxlib.__file__).parent.glob("*.so"), key=lambda p: p.stat().st_size, reverse=True)
    needle = flag.encode()
    for lib in libs[:2]:  # XLA lives in the largest library of the wheel
        try:
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(needle) >= 0:
                    return True
        except (OSError, ValueError):
            continue
    return False


def apply() -> bool:
    """Add the project's XLA flags to ``XLA_FLAGS`` where possible; True when the scheduler flag
    is in effect (set here or by the user)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if SCHEDULER_FLAG in flags:
        return f"--{SCHEDULER_FLAG}=false" in flags
    if (
        os.environ.get("SSD_JAX_XLA_DEFAULTS", "1") == "0"
        or _backend_started()
        or not _xla_knows(SCHEDULER_FLAG)
    ):
        return False
    os.environ["XLA_FLAGS"] = f"{flags} --{SCHEDULER_FLAG}=false".strip()
    return True


#: whether the memory-minimising CPU scheduler is in effect for this process (recorded by benchmarks)
MEMORY_SCHEDULER = apply()
