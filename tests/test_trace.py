"""Timeline: inferred device intervals per lane, overlap metrics, Chrome trace export."""

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from ssd_jax.decoding.trace import Timeline, lane_for


@jax.jit
def _work(x):
    # ~tens of ms of dense compute on one CPU device
    return jax.lax.fori_loop(0, 150, lambda i, y: jnp.tanh(y @ x), x)


@pytest.fixture(scope="module")
def inputs():
    devs = jax.devices()
    xs = [jax.device_put(jnp.full((256, 256), 0.01, jnp.float32), devs[i]) for i in (0, 1)]
    for x in xs:  # compile for both devices outside the timed part
        jax.block_until_ready(_work(x))
    t = time.perf_counter()
    jax.block_until_ready(_work(xs[0]))
    return devs, xs, time.perf_counter() - t


def _trace_threads():
    return {t for t in threading.enumerate() if t.name.startswith("ssd-trace")}


class _Failing:
    """A pytree leaf whose readiness wait fails, like a computation that errored."""

    def __init__(self, delay=0.0):
        self.delay = delay

    def block_until_ready(self):
        time.sleep(self.delay)
        raise RuntimeError("boom: device work failed")


def test_lane_for_names_device_sets():
    d = jax.devices()
    assert lane_for(d[0]) == "cpu:0"
    assert lane_for([d[3], d[1], d[2], d[0]]) == "cpu:0-3"
    assert lane_for([d[i] for i in (0, 2, 4, 5, 7)]) == "cpu:0,2,4-5,7"
    assert lane_for([d[1], d[1]]) == "cpu:1"
    mesh = Mesh(np.array(d[4:8]), ("tp",))
    assert lane_for(mesh) == "cpu:4-7"
    assert lane_for(jax.sharding.SingleDeviceSharding(d[6])) == "cpu:6"
    # single-device mode: target and draft on one device share one lane
    assert lane_for([d[0]]) == lane_for(d[0])
    with pytest.raises(ValueError):
        lane_for([])


def test_disjoint_lanes_record_concurrent_intervals(inputs):
    devs, (x0, x1), work_s = inputs
    la, lb = lane_for(devs[0]), lane_for(devs[1])
    assert la != lb
    with Timeline() as tl:
        t_before = time.perf_counter()
        a = _work(x0)
        tl.record("verify", la, a, round=0, k=4)
        b = _work(x1)
        tl.record("draft_cache", lb, b, round=0)
        t_dispatched = time.perf_counter()
        jax.block_until_ready((a, b))
        t_ready = time.perf_counter()
        evs = tl.events()
    assert [(e["name"], e["lane"], e["round"]) for e in evs] == [("verify", la, 0), ("draft_cache", lb, 0)]
    ev = {e["name"]: e for e in evs}
    for e in evs:
        assert t_before <= e["dispatch"] <= e["start"] <= e["end"]
        assert e["end"] >= e["dispatch"]
    assert ev["verify"]["args"] == {"k": 4}
    # nothing waited before either dispatch, so each starts at its dispatch time
    assert ev["verify"]["start"] == ev["verify"]["dispatch"]
    assert ev["draft_cache"]["start"] == ev["draft_cache"]["dispatch"] <= t_dispatched
    # the ends are stamped when the work finished, not when it was dispatched
    for e in evs:
        assert e["end"] - e["start"] > 0.5 * work_s
        assert e["end"] <= t_ready + 0.5
    # async dispatch: the draft's work was dispatched while the target's was running
    assert ev["draft_cache"]["start"] < ev["verify"]["end"]
    assert tl.overlapping_rounds("verify", "draft_cache") == 1
    assert tl.overlap_fraction("verify", "draft_cache") > 0.0


def test_shared_lane_serializes(inputs):
    devs, (x0, _), work_s = inputs
    lane = lane_for(devs[0])
    with Timeline() as tl:
        a = _work(x0)
        tl.record("verify", lane, a, round=3)
        b = _work(x0)
        tl.record("draft_cache", lane, b, round=3)
        first, second = tl.events()
    assert (first["name"], second["name"]) == ("verify", "draft_cache")
    assert first["start"] <= first["end"] <= second["start"] <= second["end"]
    # the second was dispatched while the first ran; it starts when the first ends
    assert second["dispatch"] < first["end"]
    assert second["start"] == first["end"]
    assert tl.overlapping_rounds("verify", "draft_cache") == 0
    assert tl.overlap_fraction("verify", "draft_cache") == 0.0


def _hand_made():
    tl = Timeline()
    tl.mark("a", "t", round=0, start=0.0, end=10.0)
    tl.mark("b", "d", round=0, start=5.0, end=15.0)  # overlap 5 of 10
    tl.mark("a", "t", round=1, start=20.0, end=30.0)
    tl.mark("b", "d", round=1, start=22.0, end=26.0)  # overlap 4 of 4
    tl.mark("a", "t", round=2, start=31.0, end=33.0)  # no b in round 2: ignored
    tl.mark("b", "d", round=3, start=40.0, end=42.0)  # overlap 0 of 2
    tl.mark("a", "t", round=3, start=43.0, end=50.0)
    tl.mark("b", "d", round=4, start=60.0, end=61.0)  # touches a's end: no overlap (0 of 1)
    tl.mark("a", "t", round=4, start=59.0, end=60.0)
    tl.mark("b", "d", round=5, start=70.0, end=71.0)  # no a in round 5: ignored
    return tl


def test_overlap_metrics_match_hand_computation():
    tl = _hand_made()
    assert tl.overlap_fraction("a", "b") == pytest.approx((5 + 4 + 0 + 0) / (10 + 4 + 2 + 1))
    assert tl.overlapping_rounds("a", "b") == 2
    # symmetric intersection, but normalized by the other name's durations
    assert tl.overlap_fraction("b", "a") == pytest.approx((5 + 4) / (10 + 10 + 7 + 1))
    assert tl.overlap_fraction("a", "missing") == 0.0
    assert tl.overlapping_rounds("missing", "b") == 0
    starts = [e["start"] for e in tl.events()]
    assert starts == sorted(starts) and len(starts) == 10
    with pytest.raises(ValueError):
        tl.mark("a", round=9, start=2.0, end=1.0)
    tl.close()


def test_write_chrome(tmp_path, inputs):
    devs, (x0, x1), work_s = inputs
    tl = _hand_made()
    tl.mark("sample", round=0, start=1.0, end=1.5, note="host")  # default lane "host"
    path = tmp_path / "trace.json"
    tl.write_chrome(path)
    tl.close()
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temp file left
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    meta = [e for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    tid_of = {m["args"]["name"]: m["tid"] for m in meta}
    assert set(tid_of) == {"t", "d", "host"} and len(set(tid_of.values())) == 3
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 11 and all(e["pid"] == 0 for e in xs)
    assert min(e["ts"] for e in xs) == 0.0
    by_key = {(e["name"], e["args"]["round"]): e for e in xs}
    b0 = by_key[("b", 0)]
    assert b0["tid"] == tid_of["d"]
    assert b0["ts"] == pytest.approx(5.0e6) and b0["dur"] == pytest.approx(10.0e6)
    a3 = by_key[("a", 3)]
    assert a3["tid"] == tid_of["t"]
    assert a3["ts"] == pytest.approx(43.0e6) and a3["dur"] == pytest.approx(7.0e6)
    s = by_key[("sample", 0)]
    assert s["tid"] == tid_of["host"] and s["args"] == {"round": 0, "note": "host"}
    assert s["dur"] == pytest.approx(0.5e6)

    # recorded device work round-trips with its measured duration
    with Timeline() as tl2:
        tl2.record("verify", lane_for(devs[0]), _work(x0), round=7)
        tl2.record("draft_cache", lane_for(devs[1]), _work(x1), round=7)
        evs = {e["name"]: e for e in tl2.events()}
        tl2.write_chrome(path)  # overwrites
    xs = {e["name"]: e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert set(xs) == {"verify", "draft_cache"}
    for name, e in xs.items():
        assert e["args"]["round"] == 7
        assert e["dur"] == pytest.approx((evs[name]["end"] - evs[name]["start"]) * 1e6)
        assert e["dur"] > 0


def test_write_chrome_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "trace.json"
    path.write_text("previous")
    tl = _hand_made()

    def broken_dump(obj, f, **kw):
        f.write('{"traceEvents": [')  # half a file, then a crash
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        tl.write_chrome(path)
    assert path.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]
    tl.close()


def test_disabled_is_a_noop(tmp_path):
    before = _trace_threads()
    n = threading.active_count()
    tl = Timeline(enabled=False)
    assert tl.enabled is False
    bad = _Failing(delay=5.0)  # would take 5 s and raise if it were ever waited on
    t0 = time.perf_counter()
    for r in range(1000):
        tl.record("verify", "cpu:0", bad, round=r)
        tl.mark("sample", round=r, start=0.0, end=1.0)
    tl.flush()
    assert time.perf_counter() - t0 < 0.5
    assert tl.events() == []
    assert _trace_threads() == before and threading.active_count() == n
    assert tl.overlap_fraction("verify", "sample") == 0.0
    tl.write_chrome(tmp_path / "t.json")
    assert [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"] == []
    tl.close()


def test_waiter_exception_surfaces_from_flush(inputs):
    devs, (x0, _), work_s = inputs
    tl = Timeline()
    tl.record("verify", "cpu:0", [jnp.ones(3), _Failing(delay=0.05)], round=0)
    tl.record("draft_cache", "cpu:0", _work(x0), round=0)  # later work on the lane still records
    with pytest.raises(RuntimeError, match="boom"):
        tl.flush()
    tl.flush()  # raised once, not forever
    evs = {e["name"]: e for e in tl.events()}
    assert "boom" in evs["verify"]["args"]["error"]
    assert evs["verify"]["end"] <= evs["draft_cache"]["start"] <= evs["draft_cache"]["end"]
    assert "error" not in evs["draft_cache"]["args"]
    # close() also surfaces an unflushed error, and still stops the threads
    tl.record("verify", "cpu:0", _Failing(), round=1)
    with pytest.raises(RuntimeError, match="boom"):
        tl.close()
    assert not any(t.is_alive() for t in tl._threads.values())


def test_close_stops_threads_and_is_idempotent():
    before = _trace_threads()
    with Timeline() as tl:
        tl.record("x", "cpu:0", jnp.ones(2), round=0)
        tl.record("y", "cpu:1", jnp.ones(2), round=0)
        assert len(_trace_threads() - before) == 2  # one waiter per lane
    assert _trace_threads() == before
    tl.close()
    assert len(tl.events()) == 2
    with pytest.raises(RuntimeError, match="after close"):
        tl.record("z", "cpu:0", jnp.ones(2), round=1)


def test_donated_outputs_do_not_break_the_waiter():
    with Timeline() as tl:
        gone = jnp.ones(4) + 1
        tl.record("partly_donated", "cpu:2", (gone, jnp.ones(2) * 2), round=0)
        gone.delete()  # as if a later call had donated it
        only = jnp.ones(4) * 3
        only.delete()
        tl.record("all_donated", "cpu:2", only, round=0)
        evs = {e["name"]: e for e in tl.events()}
    assert all(e["start"] <= e["end"] for e in evs.values())
    assert "error" not in evs["partly_donated"]["args"]
    assert evs["all_donated"]["args"] == {"end_inexact": True}
