"""SSD's per-bucket AR switch as a part of its own (ssd_jax.engine.methods.ar_switch), with timed rounds
given by the test: where it chooses AR rounds, what it writes into the method's set and costs, its
start-up note, and a switch without a plan. The engine-level behaviour (rounds, the draft's catch-up,
exactness) is tested in test_engine.py and test_kauto.py."""

import numpy as np
import pytest

from ssd_jax.engine.methods.ar_switch import ARSwitch
from ssd_jax.planning.policy import BucketSwitch

BUCKETS = (1, 2, 4, 8)
# seconds a round: SSD's grows with the rows (its tree), AR's hardly
T_ROUND = {1: 0.010, 2: 0.014, 4: 0.030, 8: 0.060}
T_AR = {1: 0.006, 2: 0.0065, 4: 0.007, 8: 0.008}


def _timed(ar: bool, b: int) -> float:
    return (T_AR if ar else T_ROUND)[b]


def test_ar_rounds_where_the_timed_round_does_not_pay():
    ar, costs = set(), {}
    sw = ARSwitch(BucketSwitch(k=3, tokens_per_round=2.5), 3, ar, costs)
    sw.choose(BUCKETS, _timed)
    # 2.5 tokens a round pay where 2.5 * t_ar > t_round: at 1 (0.015 > 0.010) and 2 (0.01625 > 0.014)
    assert ar == {4, 8} and sw.ar is ar  # the method's own set, filled in place
    assert set(costs) == set(BUCKETS)
    assert costs[1]["expected_speedup"] == pytest.approx(2.5 * 0.006 / 0.010)
    assert [sw.runs_ar(b) for b in BUCKETS] == [False, False, True, True]
    assert not sw.idle(BUCKETS) and sw.idle((4, 8))
    assert (
        sw.note(BUCKETS)
        == " by running rows 1: K=3 1.50x, 2: K=3 1.16x, 4: K=0 (AR, 0.58x), 8: K=0 (AR, 0.33x)"
    )


def test_a_margin_keeps_ar_rounds_where_the_gain_is_small():
    ar = set()
    ARSwitch(BucketSwitch(k=3, tokens_per_round=2.5, margin=0.2), 3, ar, {}).choose(BUCKETS, _timed)
    assert ar == {2, 4, 8}  # bucket 2's 1.16x is under the 20% margin


def test_fixed_ar_buckets_and_every_bucket():
    sw = ARSwitch(BucketSwitch(k=2, tokens_per_round=9.0, zero=(1, 2)), 2, set(), {})
    assert not sw.everywhere(BUCKETS) and sw.everywhere((1, 2))
    sw.choose(BUCKETS, _timed)
    assert sw.ar == {1, 2}


def test_without_a_plan_no_bucket_switches_and_rounds_are_counted():
    put = np.asarray
    sw = ARSwitch(None, 4, set(), {})
    sw.bind(8, put)
    assert not sw.on and sw.lagbook is None
    assert not any(sw.runs_ar(b) for b in BUCKETS) and not sw.idle(BUCKETS) and not sw.lagging()
    assert sw.note(BUCKETS) == "" and not sw.everywhere(BUCKETS)
    sw.rounds[4] += 3
    sw.restart()
    assert sw.rounds == {0: 0, 4: 0}


def test_a_plan_binds_the_idle_drafts_book():
    sw = ARSwitch(BucketSwitch(k=2, tokens_per_round=2.0), 2, set(), {})
    sw.bind(4, np.asarray)
    assert sw.lagbook.first_extra == 0 and not sw.lagging()  # SSD's AR round records cur alone
    sw.lagbook.rounds = 1
    assert sw.lagging()
