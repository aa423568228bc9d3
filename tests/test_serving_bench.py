"""The serving benchmark's pure parts (ssd_jax.bench.serving); its load runs against a live server in
tests/test_serve.py."""

import pytest

from ssd_jax.bench import serving as sb
from ssd_jax.errors import UserError


def test_poisson_arrivals_have_the_rate_and_are_seeded():
    a = sb.poisson_arrivals(2.0, 4000, seed=3)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0.0 and min(gaps) > 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.05)  # mean gap 1 / rate
    cv = (sum((g - 0.5) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.5
    assert cv == pytest.approx(
        1.0, rel=0.08
    )  # exponential gaps: sd = mean (a fixed-interval load fails this)
    assert sb.poisson_arrivals(2.0, 10, seed=3) == a[:10] and sb.poisson_arrivals(2.0, 10, seed=4) != a[:10]
    with pytest.raises(UserError):
        sb.poisson_arrivals(0.0, 3, seed=0)


def test_methods_map_to_server_flags():
    assert sb.parse_method("ar")["flags"] == ["--method", "ar"]
    m = sb.parse_method("sd:ngram:3")
    assert m["name"] == "sd-ngram-k3" and m["flags"] == ["--method", "sd", "--draft", "ngram", "--k", "3"]
    assert sb.parse_method("sd:smollm2-135m-draft")["flags"][-1] == "auto"
    assert sb.parse_method("sd:ngram:auto")["name"] == "sd-ngram-kauto"
    m = sb.parse_method("ssd:smollm2-135m-draft:4")
    assert m["name"] == "ssd-draft-k4" and m["flags"] == [
        "--method",
        "ssd",
        "--draft",
        "smollm2-135m-draft",
        "--k",
        "4",
    ]
    # a method may carry server flags of its own (one server per configuration, e.g. prefix caching off)
    m = sb.parse_method("sd:ngram:2 --no-prefix-caching --block-size 32")
    assert m["name"] == "sd-ngram-k2+no-prefix-caching+block-size+32"
    assert m["flags"][-3:] == ["--no-prefix-caching", "--block-size", "32"]
    # SSD with its draft in a process of its own: the server under the launcher
    m = sb.parse_method("ssd:smollm2-135m-draft:2 --launch")
    assert m["launch"] and m["name"] == "ssd-draft-k2+launch"
    assert (
        m["flags"][-4:] == ["--target-devices", "1", "--draft-devices", "1"] and "--launch" not in m["flags"]
    )
    with pytest.raises(UserError, match="SSD only"):
        sb.parse_method("sd:ngram:2 --launch")
    for bad in ("ssd", "sd", "sd:ngram:0", "sd:ngram:x", "beam", "ssd:ngram:3", "ar extra", ""):
        with pytest.raises(UserError):
            sb.parse_method(bad)


def test_cell_summary_percentiles_and_throughput_interval():
    reqs = [
        {"ok": True, "ttft": 0.1 * i, "tpot": 0.01 * i, "e2e": 1.0 + i, "tokens": 10} for i in range(1, 101)
    ]
    reqs.append({"ok": False, "ttft": None, "tpot": None, "e2e": 0.5, "tokens": None})
    s = sb.cell_summary(reqs, [(10.0, 500), (10.0, 520), (10.0, 510)])
    assert s["requests"] == 101 and s["failed"] == 1
    assert s["ttft"]["p50"] == pytest.approx(5.05) and s["ttft"]["p99"] == pytest.approx(9.901)
    m, lo, hi = s["throughput"]
    assert m == pytest.approx(51.0) and lo < 51.0 < hi


def test_report_compares_with_ar_and_counts_prefix_hits_and_preemptions():
    """Each method's throughput is compared with AR's at the same rate whatever the order of the methods,
    and the prefix-cache hit share and the preemptions of each cell come from the /metrics counters."""
    before = {"ssd_jax:prefix_cache_queries_total": 100.0, "ssd_jax:prefix_cache_hits_total": 10.0}
    after = {"ssd_jax:prefix_cache_queries_total": 300.0, "ssd_jax:prefix_cache_hits_total": 160.0}
    assert sb._prefix_hits(before, after) == pytest.approx(0.75) and sb._prefix_hits({}, {}) is None
    req = {"kind": "request", "rate": 1.0, "repeat": 0, "ok": True, "ttft": 0.1, "tpot": 0.01, "e2e": 1.0}
    rows = [
        {**req, "method": "sd-x", "tokens": 30},
        {**req, "method": "ar", "tokens": 20},
        {"kind": "load", "method": "sd-x", "rate": 1.0, "span": 10.0, "tokens": 30, "loadavg": 1.5,
         "prefix_hit_rate": 0.75, "preemptions": 2.0},
        {"kind": "load", "method": "ar", "rate": 1.0, "span": 10.0, "tokens": 20, "loadavg": 0.5},
    ]  # fmt: skip
    table = sb.render(rows, {"target": "t", "system_tokens": 512})
    assert "| 1 req/s | sd-x | 1 (0) | 3.0 [nan, nan] | 1.50x | - |" in table and "| 0.75 | 2 |" in table
    assert "512-token system message" in table and "per cell: 0.5-1.5" in table


def test_the_plans_prediction_is_weighted_by_the_rounds_at_each_bucket_and_loads_sort():
    """A cell's predicted speedup: each bucket's prediction weighted by the rounds run there during the
    cell; a server with one prediction for every bucket keeps it; none without a plan. Poisson rates
    sort before fixed concurrencies, each by its number."""
    before = {"plan|1": 1.5, "plan|4": 1.1, "rounds|1": 10.0, "rounds|4": 0.0}
    after = {"plan|1": 1.5, "plan|4": 1.1, "rounds|1": 40.0, "rounds|4": 10.0}
    assert sb.predicted_speedup(before, after) == pytest.approx((1.5 * 30 + 1.1 * 10) / 40)
    assert sb.predicted_speedup({}, {"plan|4": 1.2, "plan|8": 1.2}) == pytest.approx(1.2)
    assert (
        sb.predicted_speedup({}, {"plan|4": 1.2, "plan|8": 1.0}) is None
        and sb.predicted_speedup({}, {}) is None
    )
    req = {"kind": "request", "repeat": 0, "ok": True, "ttft": 0.1, "tpot": 0.01, "e2e": 1.0, "tokens": 20}
    rows = []
    for level in ("c8", 0.5, "c1", 0.1):
        rows += [{**req, "method": "ar", "rate": level},
                 {"kind": "load", "method": "ar", "rate": level, "span": 10.0, "tokens": 20, "predicted": 1.0}]  # fmt: skip
    table = sb.render(rows, {"target": "t"})
    order = [
        line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "| ar |" in line
    ]
    assert order == ["| 0.1 req/s", "| 0.5 req/s", "| concurrency 1", "| concurrency 8"]
    assert "| 1.00x |" in table
