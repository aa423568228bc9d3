"""SSD's fan-out as one part of its method, for a model draft and a head alike: the estimator of the
acceptance (:class:`~ssd_jax.decoding.ssd.fanout.FanoutEstimator`), the schedule and branch-layout tables
built from it for every row state, and each round's control vector on the draft's device."""

from __future__ import annotations

import numpy as np

from ssd_jax.decoding.ssd import host as ssd_host
from ssd_jax.decoding.ssd.rounds import Control


class FanoutTables:
    """Built with the spec (the budget ``M`` is known before the engine sizes anything); :meth:`bind` at
    set-up, once the slots are known, builds the tables.

    The schedule adapts online to the acceptance seen only with one slot: with more, the batch's outcomes
    would steer each row's tree, and a seeded row would depend on its batch mates. The tables are rebuilt
    only when the estimates move, and a control vector is uploaded once per (tables, live rows)."""

    #: control vectors kept per set of tables (one per live-row pattern seen)
    MAX_CTRLS = 64

    def __init__(self, spec, n_draft_devices: int):
        self.K = int(spec.k)
        self.uniform, self.M, self.est = ssd_host.fanout_setup(spec, n_draft_devices)

    def bind(self, batch: int, put) -> None:
        """``batch`` slots; ``put``: host array -> the draft's device."""
        self.ctl = Control(k=self.K, budget=self.M, batch=batch)
        self.adapts = batch == 1
        self._put = put
        self._build()

    def _build(self) -> None:
        self.sched, self.kb_tab, self.rb_tab = ssd_host.layout_table(self.est, self.K, self.M, self.uniform)
        self._key, self._ctrls = self.est.key(), {}

    def ctrl(self, live: np.ndarray):
        """The round's control vector on the draft's device, for the slots ``live``."""
        key = live.tobytes()
        ctrl = self._ctrls.get(key)
        if ctrl is None:
            if len(self._ctrls) > self.MAX_CTRLS:
                self._ctrls.clear()
            fan = self.sched[0, : self.K]  # the schedule of a row after a hit (layout_table's first row)
            ctrl = self._ctrls[key] = self._put(self.ctl.pack(self.kb_tab, self.rb_tab, fan, live))
        return ctrl

    def observe(self, sched, n_acc, n_draft, hit, post_miss) -> None:
        """A round's outcome for its live rows: accepted counts, the proposals verified, the next lookup's
        hits and whether a fast backup drafted after a miss; ``sched``: the tables the round ran with.
        One slot: the estimator learns; more: nothing."""
        if self.adapts:
            fan_rows = sched[np.where(post_miss, 1 + n_draft, 0)]  # each row's schedule (by its state)
            self.est.observe(n_acc, n_draft, hit, fan_rows, post_miss)

    def refresh(self) -> None:
        """New tables where the estimates moved and the schedules with them (uploaded with the next ctrl)."""
        if not self.adapts or self.est.key() == self._key:
            return
        self._key = self.est.key()
        sched, kb_tab, rb_tab = ssd_host.layout_table(self.est, self.K, self.M, self.uniform)
        if not np.array_equal(sched, self.sched):
            self.sched, self.kb_tab, self.rb_tab, self._ctrls = sched, kb_tab, rb_tab, {}

    def summary(self) -> dict:
        """The run's fan-out: mode, budget, schedules and the estimator's state."""
        return {
            "mode": "uniform" if self.uniform else "geometric",
            "budget": self.M,
            "schedule": self.est.schedule(False).tolist(),
            "post_miss_schedule": self.est.schedule(True).tolist(),
            **self.est.to_dict(),
        }
