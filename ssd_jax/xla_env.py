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

``SSD_JAX_CPUS`` (e.g. ``0``, ``0,1`` or ``2-3``): pin this process to those cores, first thing on
import (every thread the process has so far, and so every thread started later: JAX's, XLA's, gloo's).
``python -m ssd_jax.launch --cpus-per-process N`` sets it for each process it starts, and
``SSD_JAX_CPUS=0 python -m ssd_jax.decode ...`` pins a one-process run. XLA:CPU sizes its
intra-op thread pool (the ``tf_XLAEigen`` threads that run its parallel loops, its Eigen matmuls and the
project's FFI kernels) from the cores the process may run on, ``tsl::port::MaxParallelism()`` =
``CPU_COUNT(sched_getaffinity)``, unless ``PJRT_NPROC`` or ``NPROC`` is set, and at least one thread
per fake device (``--xla_force_host_platform_device_count``), so pinning before the backend starts
sizes it too. Cores outside those this process may use are refused (exit with one line).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
#: cores to pin this process to ("0", "0,1", "0-3"); set per process by ``ssd_jax.launch --cpus-per-process``
CPUS_ENV = "SSD_JAX_CPUS"


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


def parse_cpus(text: str) -> list[int]:
    """``"0"``, ``"0,2"``, ``"0-3"``, ``"0-1,4"`` -> sorted distinct core ids."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"not a core list: {text!r} (e.g. 0, 0,1 or 0-3)") from None
        if a < 0 or b < a:
            raise ValueError(f"not a core list: {text!r} (e.g. 0, 0,1 or 0-3)")
        cores.update(range(a, b + 1))
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return sorted(cores)


def cpus() -> list[int]:
    """The cores this process may run on (recorded in the metrics as ``cpus``)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def pin(cores) -> None:
    """Pin every thread of this process to ``cores`` (threads started later inherit it).

    ``sched_setaffinity(0, ...)`` on Linux pins the calling thread only, hence each task."""
    cores = set(cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # a thread that has just ended
            continue


def apply_cpus() -> list[int] | None:
    """Pin this process to ``$SSD_JAX_CPUS`` when set; the cores pinned to, or None."""
    text = os.environ.get(CPUS_ENV, "").strip()
    if not text:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit(f"error: {CPUS_ENV} needs Linux (os.sched_setaffinity)")
    try:
        cores = parse_cpus(text)
    except ValueError as e:
        raise SystemExit(f"error: {CPUS_ENV}={text}: {e}") from None
    allowed = set(os.sched_getaffinity(0))
    if not set(cores) <= allowed:
        raise SystemExit(f"error: {CPUS_ENV}={text}: this process may only use cores {sorted(allowed)}")
    pin(cores)
    if _backend_started():  # too late for XLA's pool size (its threads are pinned all the same)
        import warnings

        warnings.warn(
            f"{CPUS_ENV} applied after the JAX backend started: XLA's thread pool keeps its size",
            stacklevel=2,
        )
    return cores


#: the cores this process was pinned to on import ($SSD_JAX_CPUS), or None (not pinned here)
PINNED = apply_cpus()
#: whether the memory-minimising CPU scheduler is in effect for this process (recorded by benchmarks)
MEMORY_SCHEDULER = apply()
