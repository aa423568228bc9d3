"""SD's round model: the expected speedup S(K) over AR from an acceptance rate and measured stage costs.

SDSL's γ*-style choice, with measured costs in place of the law's parameter counts::

    S(K) = E(α, K) · t_ar / (c_round + K · t_draft_step + t_verify(K + 1))

``E(α, K) = (1 − α^(K+1)) / (1 − α)`` (:func:`ssd_jax.analysis.sdsl.expected_tokens`), ``t_ar`` one
target decode step, ``t_verify(M)`` one target forward over M tokens per row, ``t_draft_step`` one draft
step (0 for n-gram and random proposals) and ``c_round`` the round's fixed cost (the host's n-gram
lookup; 0 otherwise). Pure arithmetic over a :class:`~ssd_jax.planning.records.Costs`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ssd_jax.analysis.sdsl import expected_tokens
from ssd_jax.decoding.spec import K_MAX


def interpolate_verify(measured: Mapping[int, float], ks=range(1, K_MAX + 1)) -> dict[int, float]:
    """t_verify(K+1) for every K in ``ks`` from the K values measured (piecewise linear in K, flat
    beyond the measured range). Keys of ``measured`` are K (the forward is over K + 1 tokens)."""
    xs = sorted(int(k) for k in measured)
    if not xs:
        raise ValueError("need at least one measured verify time")
    ys = [float(measured[k]) for k in xs]
    return {int(k): float(np.interp(k, xs, ys)) for k in ks}


def expected_speedups(
    alpha: float,
    t_ar: float,
    t_verify: Mapping[int, float],
    t_draft_step: float = 0.0,
    c_round: float = 0.0,
    ks=range(1, K_MAX + 1),
) -> dict[int, float]:
    """S(K) for each K in ``ks`` (``t_verify`` keyed by K, as from :func:`interpolate_verify`)."""
    if t_ar <= 0:
        raise ValueError(f"t_ar must be > 0, got {t_ar}")
    out = {}
    for k in ks:
        round_s = c_round + k * t_draft_step + t_verify[k]
        out[int(k)] = float(expected_tokens(alpha, k) * t_ar / round_s)
    return out


def speedups_of(cal) -> dict[int, float]:
    """S(K) for K = 1..K_MAX from a :class:`~ssd_jax.planning.records.Calibration`."""
    c = cal.costs
    return expected_speedups(cal.alpha, c.t_ar, interpolate_verify(c.t_verify), c.t_draft_step, c.c_round)


def best_k(speedups: Mapping[int, float]) -> int:
    """The K of the largest S(K); ties go to the smallest K (fewer wasted draft tokens)."""
    best = max(speedups.values())
    return min(k for k, s in speedups.items() if s >= best * (1 - 1e-12))
