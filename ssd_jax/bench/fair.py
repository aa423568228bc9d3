"""The hardware-fair protocol: SSD's draft on hardware of its own, every other method on SSD's target's.

    python -m ssd_jax.launch --processes 2 --devices-per-process 1 --cpus-per-process 1 \\
        bench --suite protocol --methods ar sd:auto ssd:auto ...

runs the benchmark protocol (:mod:`ssd_jax.bench.protocol`) as two pinned processes: SSD with its
target on process 0 and its draft on process 1; AR and SD on process 0 alone, where SD's draft
shares the target's cores (the papers' baseline). Process 1 walks the same schedule, taking part
only in SSD's runs; process 0 writes the results."""

from __future__ import annotations

import dataclasses
import os
from typing import Any


def hardware_fair(specs: dict[str, Any]) -> tuple[dict[str, Any], set[str] | None, bool, dict]:
    """The hardware-fair protocol (``python -m ssd_jax.launch --processes 2 --cpus-per-process N bench
    --suite protocol ...``): under ``jax.distributed``, SSD runs its target on process 0's devices and its
    draft on process 1's (hardware of its own); every other method runs on process 0 alone, on the same
    hardware as SSD's target (SD's draft shares it, as in the papers' baseline). Returns (specs, the
    methods this process runs or None for all, whether it writes the results, the env record)."""
    import jax

    from ssd_jax.parallel.distributed import multi_process

    if not multi_process():
        return specs, None, True, {}
    n = jax.local_device_count()
    out = {
        name: dataclasses.replace(s, target_devices=n, draft_devices=n)
        if s.method == "ssd" and s.target_devices is None and s.draft_devices is None
        else s
        for name, s in specs.items()
    }
    two = {name for name, s in out.items() if s.target_devices is not None or s.draft_devices is not None}
    primary = jax.process_index() == 0
    fair = {
        "hardware_fair": {
            "processes": jax.process_count(),
            "devices_per_process": n,
            "cpus_process_0": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpus_env": os.environ.get("SSD_JAX_CPUS"),
            "two_process_methods": sorted(two),
        }
    }
    return out, (None if primary else two), primary, fair
