"""The round-cost benchmark (:mod:`ssd_jax.bench.roundcost`): its counters on a real run of the tiny model
and its table on known rows (the benchmark itself runs as ``python -m ssd_jax.roundcost``)."""

import dataclasses

from ssd_jax.bench import roundcost as rc


def test_counters_count_one_call_and_one_read_per_ar_round():
    model = rc.tiny_model()
    case = rc.Case("tiny", None, 24, 3, 1)
    counters = rc.Counters()
    prompt = [5, 6, 7, 8]
    spec = rc._spec("ar", None, "one", 3, False)
    rc._one_run(model, spec, dataclasses.replace(case, tokens=4), counters, prompt)  # compile
    row = rc._one_run(model, spec, case, counters, prompt)
    assert row["tokens"] == 24 and row["rounds"] == 24  # AR: the prefill's token and 23 decode steps
    # one compiled call a step (the prefill's included); one read of its token per decode step (the
    # prefill's token reaches the host with the admission): 23 reads over 24 steps
    assert 1.0 <= row["calls_per_round"] <= 1.1 and row["syncs_per_round"] == 23 / 24
    assert row["round_ms"] > 0


def _row(layout, method, ms, profiled=False, **kw):
    base = dict(calls_per_round=1.0, syncs_per_round=1.0, acceptance_rate=None, cache_hit_rate=None)
    return {**base, "layout": layout, "method": method, "round_ms": ms, "profiled": profiled,
            "loadavg": 1.0, "jax": "x", **kw}  # fmt: skip


def test_report_gives_each_layout_and_method_its_row():
    stages = dict(draft_ms=1.0, verify_ms=0.5, sample_ms=0.25)
    rows = [_row("one", "ssd", m) for m in (2.0, 2.0, 2.0)] + [_row("one", "ssd", 3.0, True, **stages)]
    rows += [_row("meshes", "sd", 2.0, acceptance_rate=0.5)]
    lines = rc.report(rows, "t").splitlines()
    one = next(ln for ln in lines if ln.startswith("| one | ssd |"))
    meshes = next(ln for ln in lines if ln.startswith("| meshes | sd |"))
    # the plain runs' median and interval; the profiled run only for its stage split
    assert one.startswith("| one | ssd | 2.000 [2.000, 2.000] | 1.000, 0.500, 0.250 |") and one.endswith(
        "| 3 |"
    )
    assert meshes.startswith("| meshes | sd | 2.000 | - |") and "| 0.50 | - | 1 |" in meshes
    assert not any(ln.startswith("| procs") for ln in lines)
