"""The cache-miss backup policy: ``auto`` picks the neural backup below the critical batch size b*
(Corollary 16) and the fast one above it, from a roofline cost estimate made once before the
first round and the run's own outcomes (never a clock: seeded runs reproduce).
"""

from __future__ import annotations

import numpy as np

from ssd_jax.analysis.perfmodel import ModelShape, forward_time, hardware_for_device
from ssd_jax.decoding.ssd import fanout as fo


def backup_cost_estimate(
    target_cfg, draft_cfg, *, batch: int, k: int, budget: int, draft_devices: int, context: float, device
) -> dict:
    """Build, neural re-draft and fast-backup times in units of one target verify, from the roofline model.

    Made once, before the first round, from the model shapes and the device kind (no clock is
    read), so the ``auto`` backup's per-round choice depends only on the seeded run's own
    outcomes: the same seed gives the same tokens. Reported in ``metrics["backup_model"]``.
    """
    itemsize = np.dtype(target_cfg.jnp_dtype).itemsize
    hw = hardware_for_device(device.platform, getattr(device, "device_kind", ""), itemsize)
    tgt = ModelShape.from_config("target", target_cfg)
    drf = ModelShape.from_config("draft", draft_cfg)
    t_ver = forward_time(hw, tgt, batch=batch, tokens=k + 1, context=context).total
    per_row = max(1, round(budget / max(1, draft_devices)))
    rerun = forward_time(hw, drf, batch=batch, tokens=k + 1, context=context).total
    branch = forward_time(hw, drf, batch=batch, tokens=per_row, context=context).total
    neural = k * forward_time(hw, drf, batch=batch, tokens=1, context=context).total
    return {
        "hardware": hw.name,
        "t_primary": float((rerun + k * branch) / t_ver),
        "t_neural": float(neural / t_ver),
        "t_fast": float(hw.host_overhead_s / t_ver),  # host n-gram lookups and one merge call
    }


class RunningMeans:
    """Running means with a prior (pseudo-count ``w``), for the backup decision's inputs."""

    def __init__(self, **priors):
        self._sum = {k: v * 2.0 for k, v in priors.items()}
        self._n = {k: 2.0 for k in priors}

    def add(self, name, value, n=1.0):
        self._sum[name] += value * n
        self._n[name] += n

    def __getitem__(self, name):
        return self._sum[name] / self._n[name]


def row_schedule(
    est: fo.FanoutEstimator, post_miss: bool, n_draft: int, K: int, M: int, uniform: bool
) -> np.ndarray:
    """Fan-out of one row: its schedule, restricted to the outcomes possible with n_draft proposals."""
    if n_draft >= K:
        return est.schedule(post_miss)
    out = np.zeros(K + 1, np.int64)
    if uniform:
        out[: n_draft + 1] = est.schedule(post_miss)[: n_draft + 1]
    else:
        out[: n_draft + 1] = fo.geometric_fanout(*est.schedule_params(post_miss), n_draft, M)
    return out
