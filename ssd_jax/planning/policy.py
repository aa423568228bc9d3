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
import functools
from collections import Counter
from collections.abc import Mapping

import numpy as np

from ssd_jax.analysis.sdsl import expected_tokens

__all__ = [
    "ADAPTIVE_KS",
    "BucketPlans",
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
#: α steps of a plan's lookup table (KPlan.table)
GRID = 1000
#: after this many K = 0 rounds in a row, one round speculates at the plan's best positive K: a K = 0 round
#: proposes nothing, so without it the online α could never show that speculation pays again
EXPLORE_EVERY = 64


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
    def from_costs(cls, alpha: float, costs: Mapping, k0: int, ks=ADAPTIVE_KS, zero: bool = False) -> KPlan:
        """From a calibration record's α and ``costs`` (``t_verify`` keyed by K, as strings or ints);
        ``k0``, the calibrated choice, is one of the candidates; ``zero``: K = 0 is one too."""
        tv = interpolate_verify({int(k): float(v) for k, v in costs["t_verify"].items()})
        return cls(
            float(alpha),
            float(costs["t_ar"]),
            tuple(sorted(tv.items())),
            float(costs["t_draft_step"]),
            float(costs["c_round"]),
            tuple(sorted({*ks, int(k0)})),
            zero,
        )

    #: K = 0 (a plain AR round, the draft idle) is a candidate: chosen when no K is expected to pay
    zero: bool = False

    def choose(self, alpha: float, bucket: int | None = None) -> int:
        """The best K among ``ks`` at acceptance ``alpha`` (0 when ``zero`` and none beats AR; S(0) = 1).
        ``bucket`` is ignored (one plan for every batch size; see :class:`BucketPlans`)."""
        sp = expected_speedups(
            min(max(alpha, 0.0), 1.0),
            self.t_ar,
            dict(self.t_verify),
            self.t_draft_step,
            self.c_round,
            ks=self.ks,
        )
        k = best_k(sp)
        return 0 if self.zero and sp[k] < 1.0 else k

    def speedup(self, alpha: float, k: int) -> float:
        """S(K) at acceptance ``alpha`` (S(0) = 1: an AR round)."""
        if k == 0:
            return 1.0
        return expected_speedups(
            alpha, self.t_ar, dict(self.t_verify), self.t_draft_step, self.c_round, ks=(k,)
        )[k]

    @functools.cached_property
    def table(self) -> np.ndarray:
        """:meth:`choose` at α = 0, 1/GRID, ..., 1: a round's K is one lookup (no host arithmetic per round)."""
        return np.array([self.choose(i / GRID) for i in range(GRID + 1)], np.int32)

    @functools.cached_property
    def positive_table(self) -> np.ndarray:
        """The best K > 0 on the same grid (what an exploring round runs where :attr:`table` says 0)."""
        if not self.zero:
            return self.table
        return dataclasses.replace(self, zero=False).table

    def ks_used(self) -> set[int]:
        """Every K a run may dispatch with this plan (the rounds to compile)."""
        return set(self.table.tolist()) | set(self.positive_table.tolist())

    def k_at(self, alpha: float, bucket: int | None = None) -> int:
        """:meth:`choose` at α rounded to the grid (:attr:`table`)."""
        return int(self.table[int(round(min(max(alpha, 0.0), 1.0) * GRID))])


@dataclasses.dataclass(frozen=True)
class BucketPlans:
    """One :class:`KPlan` per batch bucket (``slots.batch_buckets``): a round's K is chosen by the plan
    of the smallest bucket that holds its running rows, each calibrated at that many rows, so a lone
    request speculates with the K that pays at one row and a full batch with the K (possibly 0) that pays
    at all of them. The α estimate is shared (the calibrations measure it on the same continuation)."""

    plans: tuple[tuple[int, KPlan], ...]  # (bucket, plan), buckets ascending

    def plan(self, bucket: int | None) -> KPlan:
        if bucket is None:
            return self.plans[-1][1]
        return next((p for b, p in self.plans if b >= bucket), self.plans[-1][1])

    @property
    def alpha(self) -> float:
        return self.plans[-1][1].alpha

    @property
    def ks(self) -> tuple[int, ...]:
        return tuple(sorted({k for _, p in self.plans for k in p.ks}))

    @property
    def zero(self) -> bool:
        return any(p.zero for _, p in self.plans)

    def choose(self, alpha: float, bucket: int | None = None) -> int:
        return self.plan(bucket).choose(alpha)

    def summary(self) -> str:
        """Each bucket's K at the calibrated α and its expected speedup, e.g. "1: K=4 1.52x, 8: K=0 (AR)"."""
        out = []
        for b, p in self.plans:
            k = p.choose(p.alpha)
            out.append(f"{b}: K=0 (AR)" if k == 0 else f"{b}: K={k} {p.speedup(p.alpha, k):.2f}x")
        return ", ".join(out)

    def k_at(self, alpha: float, bucket: int | None = None) -> int:
        return self.plan(bucket).k_at(alpha)

    def ks_used(self) -> set[int]:
        return set().union(*(p.ks_used() for _, p in self.plans))


class OnlineK:
    """The K of each round of an adaptive run (see the module docstring). ``update`` after each
    round read, ``k`` for the next round dispatched; ``metrics()`` for the run's metrics."""

    def __init__(self, plan: KPlan | BucketPlans, k0: int):
        self.plan, self.k = plan, int(k0)
        self.accepted = self.rejections = 0
        self.rounds: Counter[int] = Counter()
        self.zero_run = 0  # K = 0 rounds dispatched in a row
        self.explored = 0

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
        self.k = self.plan.k_at(self.alpha)

    def k_for(self, bucket: int | None, explore: bool = True) -> int:
        """The next round's K at ``bucket`` running rows: ``k`` with one plan, else the bucket's plan at
        the current α (a table lookup)."""
        if not isinstance(self.plan, BucketPlans):
            return self.k
        plan = self.plan.plan(bucket)
        i = int(round(min(max(self.alpha, 0.0), 1.0) * GRID))
        k = int(plan.table[i])
        if k != 0:
            self.zero_run = 0
            return k
        self.zero_run += 1
        if self.zero_run < EXPLORE_EVERY or not explore:
            return 0
        self.zero_run, self.explored = 0, self.explored + 1
        return int(plan.positive_table[i])

    def metrics(self) -> dict:
        n = sum(self.rounds.values())
        return {
            "k_adaptive": True,
            "k_candidates": list(self.plan.ks),
            "k_rounds": {str(k): c for k, c in sorted(self.rounds.items())},
            "k_mean": sum(k * c for k, c in self.rounds.items()) / n if n else None,
            "alpha_online": self.alpha,
            "k_explore_rounds": self.explored,
        }
