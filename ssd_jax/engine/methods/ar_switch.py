"""SSD's per-bucket AR switch as one part of its method: the batch buckets that run AR rounds (K = 0, the
draft idle) because SSD's round does not pay there, chosen once from the rounds timed at each bucket
(:class:`~ssd_jax.planning.policy.BucketSwitch`, every process taking process 0's choice), the book of
what the idle draft missed (:class:`~ssd_jax.engine.methods.lag_book.LagBook`), and the count of rounds
of each K. Without a plan (K given, or a profiled run) no bucket switches and the book is never made."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ssd_jax.decoding.ssd import host as ssd_host
from ssd_jax.engine.methods.lag_book import LagBook
from ssd_jax.parallel import distributed as dist
from ssd_jax.planning.policy import BucketSwitch


class ARSwitch:
    def __init__(self, plan: BucketSwitch | None, k: int, ar: set[int], costs: dict[int, dict]):
        self.plan, self.k = plan, k
        # the method's own set and dict (Method.ar_buckets, Method.bucket_costs), filled in place
        self.ar, self.costs = ar, costs
        self.rounds = {0: 0, k: 0}  # rounds run at each K (0: AR rounds)
        self.lagbook: LagBook | None = None

    @property
    def on(self) -> bool:
        return self.plan is not None

    def bind(self, batch: int, put) -> None:
        """The idle draft's book for ``batch`` slots, and the constant flag its AR round takes."""
        if self.on:  # SSD's AR round records cur only: the draft's next round re-runs from it
            self.lagbook = LagBook(batch, put, first_extra=0)
            self.no_catch = put(np.bool_(False))

    def everywhere(self, buckets) -> bool:
        """Whether the plan fixes AR rounds at every bucket (K auto offline where nothing pays)."""
        return self.on and self.plan.zero is not None and set(buckets) <= set(self.plan.zero)

    def runs_ar(self, bucket) -> bool:
        return self.on and bucket in self.ar

    def idle(self, buckets) -> bool:
        """Every bucket runs AR rounds: the draft is never used."""
        return self.on and len(self.ar) == len(buckets)

    def lagging(self) -> bool:
        """Whether the draft missed AR rounds' tokens it must catch up on before SSD's next round."""
        return self.on and self.lagbook.rounds > 0

    def choose(self, buckets, timed: Callable[[bool, int], float]) -> None:
        """At each bucket, ``timed(ar, b)``'s SSD round against its AR round; AR where SSD's does not pay."""
        for b in buckets:
            t_round, t_ar = timed(False, b), timed(True, b)
            self.costs[b] = {
                "t_round_s": t_round,
                "t_ar_s": t_ar,
                "expected_speedup": self.plan.tokens_per_round * t_ar / t_round,
            }
            if not self.plan.speculates(b, t_round, t_ar):
                self.ar.add(b)
        if dist.multi_process():  # every process takes process 0's choice (each timed its own share)
            mask = dist.agree(sum(1 << i for i, b in enumerate(buckets) if b in self.ar))
            self.ar.clear()
            self.ar.update(b for i, b in enumerate(buckets) if mask >> i & 1)

    def note(self, buckets) -> str:
        """The start-up line's account of the AR buckets, e.g. "1: K=1 1.12x, 8: K=0 (AR, 0.71x)"."""
        return ssd_host.bucket_note(buckets, self.ar, self.costs, self.k) if self.on else ""

    def restart(self) -> None:
        self.rounds = {0: 0, self.k: 0}
