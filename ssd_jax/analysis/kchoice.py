"""Choosing K (speculative tokens per round) from an acceptance rate and measured stage costs.

The expected speedup of SD over AR with K draft tokens per round (SDSL's γ*-style choice, with
measured costs in place of the law's parameter counts)::

    S(K) = E(α, K) · t_ar / (c_round + K · t_draft_step + t_verify(K + 1))

``E(α, K) = (1 − α^(K+1)) / (1 − α)`` (:func:`ssd_jax.analysis.sdsl.expected_tokens`), ``t_ar``
one target decode step, ``t_verify(M)`` one target forward over M tokens per row, ``t_draft_step``
one draft step (0 for n-gram and random proposals) and ``c_round`` the round's fixed cost (the
host's n-gram lookup; 0 otherwise). Pure arithmetic: the measuring is done by
:mod:`ssd_jax.decoding.kauto`.

A calibration's α comes from a short fixed continuation and can be far from a given prompt's
(a continuation accepted in full gives α = 1, which asks for the largest K on a chat prompt that
accepts 0.4). :class:`OnlineK` therefore chooses K again after every round, among
:data:`ADAPTIVE_KS`, from α re-estimated on the run's own rounds: the same geometric
maximum-likelihood estimate as the calibration's, accepted / (accepted + rejections), with the
calibration's α as a prior worth :data:`PRIOR_WEIGHT` proposals. K is then a function of
earlier rounds' outcomes only, so every round is still an exact SD round: the output
distribution does not change, and a seeded run gives the same tokens every time.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping

import numpy as np

from ssd_jax.analysis.sdsl import expected_tokens

__all__ = [
    "ADAPTIVE_KS",
    "K_MAX",
    "KPlan",
    "OnlineK",
    "PRIOR_WEIGHT",
    "expected_speedups",
    "best_k",
    "interpolate_verify",
]

#: K is chosen among 1..K_MAX
K_MAX = 8
#: the K an adaptive run switches between (each is one compiled round program), plus the calibrated K
ADAPTIVE_KS = (1, 2, 4, 8)
#: the calibration's α counts as this many proposals in the online estimate
PRIOR_WEIGHT = 8.0


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


def best_k(speedups: Mapping[int, float]) -> int:
    """The K of the largest S(K); ties go to the smallest K (fewer wasted draft tokens)."""
    best = max(speedups.values())
    return min(k for k, s in speedups.items() if s >= best * (1 - 1e-12))


@dataclasses.dataclass(frozen=True)
class KPlan:
    """What ``k="auto"`` measured (α and the stage costs), kept to choose K again during a run.

    ``t_verify``: (K, t_verify(K + 1)) pairs for K in 1..K_MAX (as :func:`interpolate_verify`
    gives them); ``ks``: the K values the run may switch between."""

    alpha: float
    t_ar: float
    t_verify: tuple[tuple[int, float], ...]
    t_draft_step: float = 0.0
    c_round: float = 0.0
    ks: tuple[int, ...] = ADAPTIVE_KS

    @classmethod
    def from_costs(cls, alpha: float, costs: Mapping, k0: int, ks=ADAPTIVE_KS) -> KPlan:
        """From a calibration record's α and ``costs`` (``t_verify`` keyed by K, as strings or ints);
        ``k0``, the calibrated choice, is one of the candidates."""
        tv = interpolate_verify({int(k): float(v) for k, v in costs["t_verify"].items()})
        return cls(
            float(alpha),
            float(costs["t_ar"]),
            tuple(sorted(tv.items())),
            float(costs["t_draft_step"]),
            float(costs["c_round"]),
            tuple(sorted({*ks, int(k0)})),
        )

    def choose(self, alpha: float) -> int:
        """The best K among ``ks`` at acceptance ``alpha``."""
        return best_k(
            expected_speedups(
                min(max(alpha, 0.0), 1.0),
                self.t_ar,
                dict(self.t_verify),
                self.t_draft_step,
                self.c_round,
                ks=self.ks,
            )
        )


class OnlineK:
    """The K of each round of an adaptive run (see the module docstring). ``update`` after each
    round read, ``k`` for the next round dispatched; ``metrics()`` for the run's metrics."""

    def __init__(self, plan: KPlan, k0: int):
        self.plan, self.k = plan, int(k0)
        self.accepted = self.rejections = 0
        self.rounds: Counter[int] = Counter()

    @property
    def alpha(self) -> float:
        w = PRIOR_WEIGHT
        return (self.accepted + w * self.plan.alpha) / (self.accepted + self.rejections + w)

    def update(self, k_used: int, live: np.ndarray, n_acc: np.ndarray, n_draft: np.ndarray) -> None:
        """One round read: ``k_used`` its K; per row (live rows with a proposal count) the accepted and
        proposed counts. A rejection is a row that accepted fewer than it was proposed."""
        self.rounds[int(k_used)] += 1
        m = live & (n_draft > 0)
        a, d = n_acc[m], n_draft[m]
        self.accepted += int(a.sum())
        self.rejections += int((a < d).sum())
        self.k = self.plan.choose(self.alpha)

    def metrics(self) -> dict:
        n = sum(self.rounds.values())
        return {
            "k_adaptive": True,
            "k_candidates": list(self.plan.ks),
            "k_rounds": {str(k): c for k, c in sorted(self.rounds.items())},
            "k_mean": sum(k * c for k, c in self.rounds.items()) / n if n else None,
            "alpha_online": self.alpha,
        }
