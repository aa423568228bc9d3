"""SSD's own round choice (:mod:`ssd_jax.planning.ssd_model`, what ``k="auto"`` does for SSD): the
greedy hit simulation on known rank sequences, the round-time model with and without a device of
the draft's own, and end to end on a tiny pair (the chosen K and budget are used, tokens = AR)."""

import dataclasses

import numpy as np
import pytest
from test_sd import PROMPTS, _ids

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.planning import ssd_model as plan
from ssd_jax.planning.records import Calibration

SP = SamplingParams(max_new_tokens=20, ignore_eos=True)


def test_simulated_rounds_on_known_ranks():
    # the draft always right: every round accepts K; the bonus (rank 0) is a hit if F_K >= 1
    ranks = np.zeros(40, np.int64)
    n, h, tok = plan.simulate_rounds(ranks, 1, 4, np.array([1, 1, 1, 1, 1]))
    assert tok == 5 * n and h == n
    assert plan.simulate_rounds(ranks, 1, 4, np.array([2, 1, 1, 1, 0]))[1] == 0  # no branch at k = K
    # the draft never right, the target's token its 2nd choice: k = 0, bonus rank 1
    ranks = np.ones(40, np.int64)
    n, h, tok = plan.simulate_rounds(ranks, 1, 3, np.array([1, 0, 0, 1]))
    assert tok == n and h == n  # rank 1 <= F_0 = 1: the proposal (rank 0) is never a branch
    assert plan.simulate_rounds(ranks, 1, 3, np.array([0, 1, 1, 0]))[1] == 0
    # rank 3 at a rejection needs F_k >= 3
    ranks = np.array([0, 3] * 20)  # every round: one accepted, then a bonus of rank 3 (bucket k = 1)
    n, h, tok = plan.simulate_rounds(ranks, 1, 2, np.array([0, 3, 0]))
    assert n > 0 and h == n and tok == 2 * n
    assert plan.simulate_rounds(ranks, 1, 2, np.array([3, 2, 0]))[1] == 0


def test_interpolate_rows():
    t = {1: 1.0, 4: 2.5, 12: 6.5}
    assert plan.interpolate_rows(t, 1) == 1.0 and plan.interpolate_rows(t, 8) == pytest.approx(4.5)
    assert plan.interpolate_rows(t, 20) == pytest.approx(10.5)  # the last segment's slope beyond
    assert plan.interpolate_rows({3: 2.0}, 10) == 2.0


def _record(t_row_slope):
    rng = np.random.default_rng(0)
    ranks = [np.where(rng.random(200) < 0.7, 0, rng.integers(1, 4, 200)).tolist() for _ in range(2)]
    return Calibration.from_json(
        {
            "alpha": 0.7,
            "ranks": ranks,
            "rank_start": 1,
            "costs": {
                "t_ar": 1.0,
                "t_verify": {"1": 1.0, "4": 1.1, "8": 1.3},
                "t_draft_step": 0.2,
                "t_draft_rows": {"1": 0.2, "4": 0.2 + 3 * t_row_slope, "12": 0.2 + 11 * t_row_slope},
            },
        }
    )


def test_the_round_model_hides_the_build_only_on_a_device_of_its_own():
    rec = _record(0.05)
    own = {(p["k"], p["budget"]): p for p in plan.round_plans(rec, 1, overlap=True)}
    shared = {(p["k"], p["budget"]): p for p in plan.round_plans(rec, 1, overlap=False)}
    assert own.keys() == shared.keys() and (4, 10) in own
    for key, p in own.items():
        q = shared[key]
        assert p["hit_rate"] == q["hit_rate"] and p["round_s"] <= q["round_s"]
        assert q["round_s"] >= p["verify_s"] + p["build_s"] - 1e-12  # one device: verify, then build
        assert 0 <= p["hit_rate"] <= 1 and 1 <= p["tokens_per_round"] <= p["k"] + 1
    # more branches never lower the hit rate (the schedule only grows)
    assert own[(4, 5)]["hit_rate"] <= own[(4, 10)]["hit_rate"] <= own[(4, 15)]["hit_rate"]
    best_own, best_shared = plan.best_plan(list(own.values())), plan.best_plan(list(shared.values()))
    assert best_own["expected_speedup"] > best_shared["expected_speedup"]
    # a build that costs more per row: every round slower, so the best expected speedup falls
    costly = {(p["k"], p["budget"]): p for p in plan.round_plans(_record(0.5), 1, overlap=True)}
    assert all(costly[key]["build_s"] > own[key]["build_s"] for key in own if key[1] > 1)
    assert plan.best_plan(list(costly.values()))["expected_speedup"] < best_own["expected_speedup"]


def test_ssd_k_auto_chooses_its_round_and_stays_exact(pair, ar_ref, tmp_path, monkeypatch, speculating):
    monkeypatch.setenv("SSD_JAX_KAUTO_CACHE", str(tmp_path))
    target, draft = pair
    res = generate(target, PROMPTS, SP, SpecConfig(method="ssd", draft=draft, backup="neural"))
    m = res.metrics
    chosen = m["k_auto"]["ssd_plan"]
    assert m["k"] == chosen["k"] and m["fanout"]["budget"] == chosen["budget"]
    assert m["k_auto"]["ssd_overlap_model"] is False  # one device: the build is not hidden
    assert _ids(res) == ar_ref
    # a budget given by hand is kept; only K is chosen
    fixed = generate(target, PROMPTS, SP, SpecConfig(method="ssd", draft=draft, fan_out_budget=3))
    assert fixed.metrics["fanout"]["budget"] == 3 and _ids(fixed) == ar_ref


def test_the_measured_build_scales_the_composed_one_and_can_move_the_budget():
    """The calibration times SSD's whole build once (``t_build``); the round model scales every composed
    build by measured / composed at that (K, M), so a build the tree's own work makes slower prices every
    budget higher, and a budget whose build no longer hides behind the verify loses to a smaller one."""
    rec = _record(0.0)
    c = dataclasses.replace(rec.costs, t_draft_rows={1: 0.05, 4: 0.05, 12: 0.1})
    rec = dataclasses.replace(rec, costs=c)
    composed = plan.composed_build(dict(c.t_draft_rows), 1, 3, 12)
    assert composed == pytest.approx(0.05 + 3 * 0.1)
    slow = dataclasses.replace(c, t_build={"k": 3, "budget": 12, "rows": 1, "s": 3.0 * composed})
    assert plan.measured_build_scale(slow) == pytest.approx(3.0) and plan.measured_build_scale(c) == 1.0
    base = {(p["k"], p["budget"]): p for p in plan.round_plans(rec, 1, overlap=True)}
    scaled = {
        (p["k"], p["budget"]): p for p in plan.round_plans(dataclasses.replace(rec, costs=slow), 1, True)
    }
    for key, p in base.items():
        assert scaled[key]["build_s"] == pytest.approx(3.0 * p["build_s"])
    # K = 4: every build hides behind the 1.1 s verify until tripled; then the 15-branch one does not
    assert all(base[(4, m)]["build_s"] < base[(4, m)]["verify_s"] for m in (5, 15))
    assert scaled[(4, 15)]["round_s"] > base[(4, 15)]["round_s"]
    assert scaled[(4, 5)]["round_s"] == pytest.approx(base[(4, 5)]["round_s"])
