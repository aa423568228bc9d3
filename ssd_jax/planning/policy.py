"""K policies: the K of each round of a run, from the plan made at start-up and the run's own acceptance.

Every policy answers the same two questions (:class:`KPolicy`): ``k_for(bucket, alpha)``, the K of a
round over ``bucket`` running rows at acceptance ``alpha`` (0: an AR round, the draft idle), and
``ks_at(bucket)``, every K such a round may run (the programs to compile). Three implement it:

* :class:`KPlan`: SD's S(K) (:mod:`ssd_jax.planning.sd_model`) over one calibration, as a lookup table
  on an α grid;
* :class:`BucketPlans`: one ``KPlan`` per batch bucket, each calibrated at that many rows;
* :class:`BucketSwitch`: SSD in a server on one device: its calibrated K, or AR rounds at the buckets
  where its timed round does not pay.

A calibration's α comes from a short fixed continuation and can be far from a given prompt's (a
continuation accepted in full gives α = 1, which asks for the largest K on a chat prompt that accepts
0.4). :class:`OnlineK` therefore re-estimates α on the run's own rounds after every round read: the same
geometric maximum-likelihood estimate as the calibration's, accepted / (accepted + rejections), with the
calibration's α as a prior worth :data:`PRIOR_WEIGHT` proposals. K is then a function of earlier rounds'
outcomes only, so every round is still an exact SD round: the output distribution does not change, and
a seeded run gives the same tokens every time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from ssd_jax.decoding.spec import K_MAX
from ssd_jax.planning.sd_model import best_k, expected_speedups, interpolate_verify

__all__ = [
    "ADAPTIVE_KS",
    "BucketPlans",
    "BucketSwitch",
    "EXPLORE_EVERY",
    "K_MAX",
    "KPlan",
    "KPolicy",
    "OnlineK",
    "PRIOR_WEIGHT",
    "SERVING_MARGIN",
    "beats_ar",
]

#: the K an adaptive run switches between (each is one compiled round program), plus the calibrated K
ADAPTIVE_KS = (1, 2, 4, 8)
#: the calibration's α counts as this many proposals in the online estimate
PRIOR_WEIGHT = 8.0
#: α steps of a plan's lookup table (KPlan.table)
GRID = 1000
#: after this many K = 0 rounds in a row, one round speculates at the plan's best positive K: a K = 0 round
#: proposes nothing, so without it the online α could never show that speculation pays again
EXPLORE_EVERY = 64


class KPolicy(Protocol):
    """What the engine asks of a plan, round by round."""

    #: the calibrated acceptance (the online estimate's prior)
    alpha: float

    @property
    def ks(self) -> tuple[int, ...]: ...

    def k_for(self, bucket: int | None, alpha: float) -> int:
        """The K of a round over ``bucket`` running rows at acceptance ``alpha`` (0: an AR round)."""
        ...

    def explore_k(self, bucket: int | None, alpha: float) -> int:
        """The best K > 0 there (what a round that explores runs where :meth:`k_for` says 0)."""
        ...

    def ks_at(self, bucket: int | None) -> set[int]:
        """Every K a round over ``bucket`` rows may run, exploring rounds included."""
        ...


def _grid(alpha: float) -> int:
    return int(round(min(max(alpha, 0.0), 1.0) * GRID))


#: A run speculates only where its predicted speedup over AR exceeds 1 + this (:func:`beats_ar`): the
#: planner's own prediction error as the hardware-fair protocol measured it (docs/serving.md#k-by-batch-bucket):
#: at 95b4e24 SD's speedup over AR was predicted 12% (SmolLM2) and 20% (Qwen pair) above the measurement, so
#: a predicted gain below 12% is within the model's error. A server applies it per batch bucket; an offline
#: run with K auto to the whole run (:mod:`ssd_jax.planning.configure`: AR rounds where nothing beats it).
#: The outside serving benchmark's case, SD on SmolLM2 at 4 rows predicted 1.01x and measured 0.87x, runs
#: AR rounds under it (not re-measured).
SERVING_MARGIN = 0.12


def beats_ar(speedup: float, margin: float = SERVING_MARGIN) -> bool:
    """Whether a configuration predicted at ``speedup`` x AR is worth speculating with: above AR by more
    than ``margin`` (the planner's error); else AR rounds."""
    return speedup >= 1.0 + margin


@dataclasses.dataclass(frozen=True)
class KPlan:
    """SD's plan from one calibration: α and the stage costs, kept to choose K again during a run.

    ``t_verify``: (K, t_verify(K + 1)) pairs for K in 1..K_MAX (as :func:`interpolate_verify` gives
    them); ``ks``: the K values the run may switch between; ``zero``: K = 0 (a plain AR round, the
    draft idle) is a candidate, chosen when no K is expected to pay; ``margin``: with ``zero``, a K must be
    expected to beat AR by more than this share (K auto: :data:`SERVING_MARGIN`)."""

    alpha: float
    t_ar: float
    t_verify: tuple[tuple[int, float], ...]
    t_draft_step: float = 0.0
    c_round: float = 0.0
    ks: tuple[int, ...] = ADAPTIVE_KS
    zero: bool = False
    margin: float = 0.0

    @classmethod
    def from_costs(
        cls, alpha: float, costs, k0: int, ks=ADAPTIVE_KS, zero: bool = False, margin: float = 0.0
    ) -> KPlan:
        """From a calibration's α and :class:`~ssd_jax.planning.records.Costs` (or their JSON form);
        ``k0``, the calibrated choice, is one of the candidates."""
        if isinstance(costs, Mapping):
            from ssd_jax.planning.records import Costs

            costs = Costs.from_json(costs)
        tv = interpolate_verify(costs.t_verify)
        return cls(
            float(alpha),
            float(costs.t_ar),
            tuple(sorted(tv.items())),
            float(costs.t_draft_step),
            float(costs.c_round),
            tuple(sorted({*ks, int(k0)})),
            zero,
            float(margin),
        )

    def choose(self, alpha: float) -> int:
        """The best K among ``ks`` at acceptance ``alpha`` (0 when ``zero`` and none beats AR by more than
        ``margin``; S(0) = 1)."""
        sp = expected_speedups(
            min(max(alpha, 0.0), 1.0),
            self.t_ar,
            dict(self.t_verify),
            self.t_draft_step,
            self.c_round,
            ks=self.ks,
        )
        k = best_k(sp)
        return 0 if self.zero and not beats_ar(sp[k], self.margin) else k

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
        return dataclasses.replace(self, zero=False, margin=0.0).table

    def k_for(self, bucket: int | None, alpha: float) -> int:
        """:meth:`choose` at α rounded to the grid; ``bucket`` is ignored (one plan for every batch)."""
        return int(self.table[_grid(alpha)])

    def explore_k(self, bucket: int | None, alpha: float) -> int:
        return int(self.positive_table[_grid(alpha)])

    def ks_at(self, bucket: int | None = None) -> set[int]:
        return set(self.table.tolist()) | set(self.positive_table.tolist())


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

    def summary(self) -> str:
        """Each bucket's K at the calibrated α and its expected speedup, e.g. "1: K=4 1.52x, 8: K=0 (AR)"."""
        out = []
        for b, p in self.plans:
            k = p.choose(p.alpha)
            out.append(f"{b}: K=0 (AR)" if k == 0 else f"{b}: K={k} {p.speedup(p.alpha, k):.2f}x")
        return ", ".join(out)

    def k_for(self, bucket: int | None, alpha: float) -> int:
        return self.plan(bucket).k_for(bucket, alpha)

    def expected(self) -> dict[int, float]:
        """Each bucket's expected speedup over AR at the calibrated α (1.0 where it runs AR rounds)."""
        out = {}
        for b, p in self.plans:
            k = p.choose(p.alpha)
            out[b] = 1.0 if k == 0 else float(p.speedup(p.alpha, k))
        return out

    def explore_k(self, bucket: int | None, alpha: float) -> int:
        return self.plan(bucket).explore_k(bucket, alpha)

    def ks_at(self, bucket: int | None = None) -> set[int]:
        if bucket is None:
            return set().union(*(p.ks_at() for _, p in self.plans))
        return self.plan(bucket).ks_at()


@dataclasses.dataclass(frozen=True)
class BucketSwitch:
    """SSD's policy in a server on one device: at each batch bucket, rounds at the calibrated K or AR
    rounds (K = 0, the draft idle; :mod:`ssd_jax.decoding.sd_lag`) where its round cannot pay.

    SSD's K and fan-out budget fix its tree's shapes, so the choice per bucket is binary. It is made at
    start-up from what the engine's own compiled rounds cost at that bucket (timed, not modelled: the
    one-device round model of :mod:`ssd_jax.planning.ssd_model` underprices the fused round) and the
    tokens a round emits per row (that model's simulation): speculate where
    ``tokens_per_round · t_ar(b) > t_round(b)``. ``zero`` fixes the AR buckets instead (tests)."""

    k: int
    tokens_per_round: float
    alpha: float = 0.0
    zero: tuple[int, ...] | None = None
    margin: float = 0.0  # SSD speculates at a bucket only where it beats AR by more than this share

    @property
    def ks(self) -> tuple[int, ...]:
        return (self.k,)

    def k_for(self, bucket: int | None, alpha: float) -> int:
        """K at every bucket; the engine runs AR rounds at the buckets :meth:`speculates` refused."""
        return self.k

    def explore_k(self, bucket: int | None, alpha: float) -> int:
        return self.k

    def ks_at(self, bucket: int | None = None) -> set[int]:
        return {self.k}

    def speculates(self, bucket: int, t_round: float, t_ar: float) -> bool:
        if self.zero is not None:
            return bucket not in self.zero
        return self.tokens_per_round * t_ar > t_round * (1.0 + self.margin)


class OnlineK:
    """The K of each round of an adaptive run (see the module docstring). ``update`` after each
    round read, ``k_for`` for the next round dispatched; ``metrics()`` for the run's metrics."""

    def __init__(self, plan: KPolicy):
        self.plan = plan
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

    @property
    def k(self) -> int:
        """The K the plan gives at the current α over every running row (a run's summary)."""
        return self.plan.k_for(None, self.alpha)

    def k_for(self, bucket: int | None, explore: bool = True) -> int:
        """The next round's K at ``bucket`` running rows (a table lookup at the current α); after
        :data:`EXPLORE_EVERY` AR rounds in a row, one round at the best K > 0."""
        k = self.plan.k_for(bucket, self.alpha)
        if k != 0:
            self.zero_run = 0
            return k
        self.zero_run += 1
        if self.zero_run < EXPLORE_EVERY or not explore:
            return 0
        self.zero_run, self.explored = 0, self.explored + 1
        return self.plan.explore_k(bucket, self.alpha)

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
