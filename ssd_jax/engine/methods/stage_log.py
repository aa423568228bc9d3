"""SSD's stage log as one part of its method: the timeline of a profiled run's device work (``--profile-stages``
or ``--trace``), in one lane for the target's devices, one for the draft's and one for the host, with a time
origin every process shares; at the end, the stage times and (``--trace``) the Chrome trace. Off (not
profiled), every call records nothing."""

from __future__ import annotations

import time

import jax

from ssd_jax.decoding.ssd import host as ssd_host
from ssd_jax.decoding.trace import Timeline
from ssd_jax.parallel import distributed as dist

#: the stage metrics a run reports (None where it was not profiled)
STAGES = ("draft_s", "draft_exposed_s", "verify_s", "sample_s", "overhead_s", "overlap_fraction")


class StageLog:
    def __init__(self, placement, enabled: bool, trace_path: str | None = None):
        self.enabled, self.trace_path = enabled, trace_path
        self.lanes = {
            "target": ssd_host.lane(placement.target_devices),
            "draft": ssd_host.lane(placement.draft_devices),
            "host": f"host p{jax.process_index()}" if dist.multi_process() else "host",
        }
        self.tl, self.origin = Timeline(enabled=enabled), time.perf_counter()  # (the warm-up's, dropped)

    def restart(self) -> None:
        """A new timeline (after the warm-up), from a time origin every process takes together."""
        self.tl = Timeline(enabled=self.enabled)
        if self.enabled and dist.multi_process():
            dist.sync_clock("ssd_trace_origin")  # a common time origin for every process's events
        self.origin = time.perf_counter()

    def record(self, stage: str, lane: str, value, round: int) -> None:
        """``stage`` ran on ``lane`` ("target" or "draft") until ``value`` is ready (profiled runs wait)."""
        self.tl.record(stage, self.lanes[lane], value, round=round)

    def mark(self, stage: str, round: int, start: float, end: float) -> None:
        """Host work of the round (e.g. the n-gram lookup), from ``start`` to ``end``."""
        self.tl.mark(stage, self.lanes["host"], round=round, start=start, end=end)

    def metrics(self, wall: float, ttft: float) -> dict:
        """The run's stage times (None each where not profiled); writes the trace where asked (process 0)."""
        self.tl.close()
        tl = self.tl
        if self.enabled and dist.multi_process():  # every process's lanes, on process 0
            tl = ssd_host.merged_timeline(tl, self.origin)
        if self.trace_path and dist.is_main() and tl is not None:
            tl.write_chrome(self.trace_path)
        if self.enabled and tl is not None:
            return ssd_host.stage_metrics(tl, wall, ttft)
        return dict.fromkeys(STAGES)
