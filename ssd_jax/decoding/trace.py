"""A host-side timeline of device work, for showing (and measuring) overlap.

In speculative speculative decoding each round dispatches the target's verify on the
target's devices and, without waiting for it, the draft's cache construction on the
draft's (disjoint) devices. To show that the two really run at the same time we record,
per piece of device work, when it started and when it ended, and export the result as a
Chrome / Perfetto trace (``--trace FILE``, open it in https://ui.perfetto.dev).

JAX gives no device-side timestamps without its profiler, so times are inferred on the
host:

* **Lanes.** A lane is a set of devices that executes work in dispatch order (one XLA
  stream per device). Lanes are named from device ids by :func:`lane_for`, e.g.
  ``"cpu:0-3"``; when target and draft share a device they share a lane, so their events
  serialize in the trace, as they do on the device.
* **Dispatch.** :meth:`Timeline.record` is called right after a jitted call returns (JAX
  dispatches asynchronously, so this is long before the work is done). It stamps the
  dispatch time with :func:`time.perf_counter` and queues the call's output pytree for
  the lane's waiter thread (one daemon thread per lane, FIFO, so waits happen in
  dispatch order).
* **End.** The waiter calls :func:`jax.block_until_ready` on the outputs and stamps the
  moment it returns.
* **Start.** ``start = max(dispatch, end of the previous event on the same lane)``: the
  device cannot start the work before it was dispatched, nor before the earlier work on
  its stream has finished.

Limits (all of them make an interval a little *wider* than the true one, so overlap
between lanes is an upper estimate; compare with a profiler trace before trusting small
numbers):

* ``start`` is a lower bound. The work may wait on inputs coming from another lane (e.g.
  the draft consuming the target's accepted tokens), on host-to-device copies, or on
  anything that did not go through :meth:`Timeline.record` on the same lane. Conversely,
  work can begin before the jitted call returns to Python; pass ``dispatch=`` (a
  :func:`time.perf_counter` stamp taken just before the call) to cover that.
* ``end`` is late by the waiter's wake-up latency: ``block_until_ready`` releases the
  GIL while it waits, but stamping needs it back, which can take up to
  :func:`sys.getswitchinterval` (5 ms by default) while the main thread runs Python.
* Outputs that a later call *donates* (e.g. a KV cache passed with ``donate_argnums``)
  may be deleted before the waiter gets to them; such leaves are skipped. If every leaf
  was donated the end cannot be observed: it is stamped when the waiter notices and the
  event gets ``args["end_inexact"] = True``. Record outputs that are not donated (the
  sampled tokens, say) to avoid this.
* Spans added with :meth:`Timeline.mark` are taken as given and do not take part in the
  lane ordering above.

The waiter keeps the outputs alive until they are ready, which delays freeing their
buffers by at most that long. With ``Timeline(enabled=False)`` every method is a cheap
no-op: no threads, no blocking, no events.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

import jax

__all__ = ["Timeline", "lane_for"]

_STOP = object()


def lane_for(devices) -> str:
    """A lane name for a set of devices: ``"<platform>:<ids>"`` with ids as ranges.

    Accepts one ``jax.Device``, an iterable of them (any order, duplicates ignored), a
    ``jax.sharding.Mesh`` or a ``jax.sharding.Sharding``. Examples: ``"cpu:0"``,
    ``"cpu:0-3"``, ``"cuda:0,2,4-5"``; devices of several platforms are joined by ``+``.
    """
    if hasattr(devices, "device_set"):  # a Sharding
        devices = devices.device_set
    elif hasattr(devices, "devices") and hasattr(devices, "axis_names"):  # a Mesh
        devices = devices.devices.flat
    elif isinstance(devices, jax.Device):
        devices = [devices]
    by_platform: dict[str, set[int]] = {}
    for d in devices:
        by_platform.setdefault(d.platform, set()).add(int(d.id))
    if not by_platform:
        raise ValueError("lane_for needs at least one device")
    return "+".join(f"{p}:{_ranges(sorted(ids))}" for p, ids in sorted(by_platform.items()))


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 3, 6, 8, 9] -> "0-3,6,8-9"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def _deleted(x) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()


def _elsewhere(outputs) -> bool:
    """Work on another process's devices only (multi-process runs): this process cannot see it end;
    that process records it."""
    arrays = [x for x in jax.tree_util.tree_leaves(outputs) if isinstance(x, jax.Array)]
    return bool(arrays) and all(not x.is_fully_addressable and not x.addressable_shards for x in arrays)


def _wait_ready(outputs) -> bool:
    """Block until every live array in ``outputs`` is ready.

    Arrays deleted by donation (before or during the wait) are skipped; any other error
    propagates. Returns False when ``outputs`` had arrays but all of them were deleted,
    i.e. when readiness could not be observed.
    """
    leaves = jax.tree_util.tree_leaves(outputs)
    had_arrays = any(isinstance(x, jax.Array) for x in leaves)
    while True:
        leaves = [x for x in leaves if not _deleted(x)]
        try:
            jax.block_until_ready(leaves)
        except Exception:
            # An array donated since the filter above: retry without it. Anything else
            # (a failed computation, a bad leaf) is a real error.
            if not any(_deleted(x) for x in leaves):
                raise
            continue
        return not had_arrays or any(isinstance(x, jax.Array) for x in leaves)


class Timeline:
    """Records when device work starts and ends, per lane; see the module docstring.

    Usage::

        tl = Timeline(enabled=bool(args.trace))
        out = verify(...)                      # async dispatch
        tl.record("verify", target_lane, out, round=r)
        cache = build_cache(...)               # dispatched without waiting
        tl.record("draft_cache", draft_lane, cache, round=r)
        ...
        tl.close()                             # flush + stop the waiter threads
        tl.write_chrome(args.trace)
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._queues: dict[str, queue.Queue] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._errors: list[BaseException] = []
        self._closed = False

    # -- recording ---------------------------------------------------------------------

    def record(
        self, name: str, lane: str, outputs, *, round: int, dispatch: float | None = None, **args
    ) -> None:
        """Record device work just dispatched on ``lane`` whose results are ``outputs``.

        ``outputs`` is any pytree (usually what the jitted call returned); its end is
        when all of its arrays are ready. ``dispatch`` defaults to now. Extra keyword
        arguments go to the event's ``args``.
        """
        if not self.enabled or _elsewhere(outputs):
            return
        t = time.perf_counter() if dispatch is None else float(dispatch)
        if self._closed:
            raise RuntimeError("Timeline.record after close()")
        ev = dict(name=name, lane=lane, round=int(round), start=None, end=None, dispatch=t, args=dict(args))
        with self._lock:
            self._events.append(ev)
            q = self._queues.get(lane)
            if q is None:
                q = self._queues[lane] = queue.Queue()
                th = threading.Thread(target=self._waiter, args=(q,), daemon=True, name=f"ssd-trace[{lane}]")
                self._threads[lane] = th
                th.start()
        q.put((ev, outputs))

    def mark(self, name: str, lane: str = "host", *, round: int, start: float, end: float, **args) -> None:
        """Record a span measured by the caller (``perf_counter`` seconds), e.g. host work."""
        if not self.enabled:
            return
        if end < start:
            raise ValueError(f"mark {name!r}: end {end} is before start {start}")
        ev = dict(
            name=name,
            lane=lane,
            round=int(round),
            start=float(start),
            end=float(end),
            dispatch=float(start),
            args=dict(args),
        )
        with self._lock:
            self._events.append(ev)

    def add_events(self, events: Iterable[dict[str, Any]]) -> None:
        """Add finished events (e.g. another process's, gathered after the run) as they are."""
        with self._lock:
            self._events += [dict(e, args=dict(e.get("args", {}))) for e in events]

    def _waiter(self, q: queue.Queue) -> None:
        lane_end = float("-inf")  # end of the previous event on this lane
        while True:
            item = q.get()
            try:
                if item is _STOP:
                    return
                ev, outputs = item
                try:
                    observed = _wait_ready(outputs)
                except Exception as e:  # re-raised from flush()
                    observed = True
                    ev["args"]["error"] = f"{type(e).__name__}: {e}"
                    with self._lock:
                        self._errors.append(e)
                end = time.perf_counter()
                del item, outputs  # release the buffers now, not at the next q.get()
                with self._lock:
                    ev["start"] = max(ev["dispatch"], lane_end)
                    ev["end"] = max(end, ev["start"])
                    if not observed:
                        ev["args"]["end_inexact"] = True
                lane_end = ev["end"]
            finally:
                q.task_done()

    # -- waiting -----------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every recorded event has its end time.

        Re-raises (once) the first exception a waiter hit, e.g. a failed computation.
        """
        if not self.enabled:
            return
        with self._lock:
            queues = list(self._queues.values())
        for q in queues:
            q.join()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Flush and stop the waiter threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            with self._lock:
                lanes = list(self._threads)
            for lane in lanes:
                self._queues[lane].put(_STOP)
            for lane in lanes:
                self._threads[lane].join()

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # don't mask the exception already in flight
                pass

    # -- reading -----------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        """Every event (copies), sorted by start: name, lane, round, start, end, dispatch, args.

        Flushes first, so it may raise a waiter's exception.
        """
        self.flush()
        with self._lock:
            evs = [dict(e, args=dict(e["args"])) for e in self._events]
        evs.sort(key=lambda e: (e["start"], e["dispatch"], e["end"]))
        return evs

    def _spans(self, name: str, evs: Iterable[dict]) -> dict[int, tuple[float, float]]:
        """round -> (first start, last end) over the events called ``name`` in that round."""
        spans: dict[int, tuple[float, float]] = {}
        for e in evs:
            if e["name"] == name:
                s, t = spans.get(e["round"], (e["start"], e["end"]))
                spans[e["round"]] = (min(s, e["start"]), max(t, e["end"]))
        return spans

    def _pairs(self, a: str, b: str):
        evs = self.events()
        sa, sb = self._spans(a, evs), self._spans(b, evs)
        return [(sa[r], sb[r]) for r in sorted(sa.keys() & sb.keys())]

    def overlap_fraction(self, a: str, b: str) -> float:
        """Share of ``b``'s time spent while ``a`` (of the same round) was running.

        Over the rounds that have both: sum of |a ∩ b| / sum of |b|, 0.0 if there are
        none. Several events of one name in a round count as one span (first start to
        last end).
        """
        inter = total = 0.0
        for (a0, a1), (b0, b1) in self._pairs(a, b):
            inter += max(0.0, min(a1, b1) - max(a0, b0))
            total += b1 - b0
        return inter / total if total > 0 else 0.0

    def overlapping_rounds(self, a: str, b: str) -> int:
        """Number of rounds having both, in which ``b`` and ``a`` overlap in time."""
        return sum(1 for (a0, a1), (b0, b1) in self._pairs(a, b) if b0 < a1 and b1 > a0)

    # -- export ------------------------------------------------------------------------

    def write_chrome(self, path) -> None:
        """Write a Chrome trace-event JSON file (Perfetto opens it), atomically.

        One complete ("X") event per recorded event, ``ts``/``dur`` in microseconds from
        the first event's start, pid 0 and one tid per lane (named by "M" metadata
        events, in order of first use).
        """
        evs = self.events()
        t0 = evs[0]["start"] if evs else 0.0
        tids: dict[str, int] = {}
        for e in evs:
            tids.setdefault(e["lane"], len(tids))
        trace: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "ssd_jax"}}
        ]
        for lane, tid in tids.items():
            trace.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": lane}})
            trace.append(
                {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}}
            )
        for e in evs:
            trace.append(
                {
                    "name": e["name"],
                    "cat": e["lane"],
                    "ph": "X",
                    "pid": 0,
                    "tid": tids[e["lane"]],
                    "ts": (e["start"] - t0) * 1e6,
                    "dur": (e["end"] - e["start"]) * 1e6,
                    "args": {"round": e["round"], **e["args"]},
                }
            )
        path = os.fspath(path)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(os.path.abspath(path))
        )
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f, default=str)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
