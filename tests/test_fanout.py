"""SSD fan-out (Theorem 12), its online estimator, branch layout, and the backup policy (Cor. 16).

Pure numpy (nothing is compiled); the whole file runs in a few seconds.
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd_jax.decoding.ssd import fanout as fo

FAST = settings(max_examples=150, deadline=None)


# --- round_to_budget -------------------------------------------------------------------------
@FAST
@given(
    st.lists(st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=12),
    st.integers(0, 500),
)
def test_round_to_budget_is_hamilton_rounding(weights, budget):
    w = np.array(weights)
    out = fo.round_to_budget(w, budget)
    assert out.dtype == np.int64 and out.shape == w.shape
    assert out.sum() == budget and np.all(out >= 0)
    if w.sum() == 0:
        assert out[0] == budget
        return
    quota = budget * w / w.sum()
    assert np.all(np.abs(out - quota) < 1.0 + 1e-9)  # every entry is the floor or the ceiling of its quota
    frac = quota - np.floor(quota)
    up = out > np.floor(quota) + 0.5
    if up.any() and (~up).any():  # the rounded-up entries have the largest remainders
        assert frac[up].min() >= frac[~up].max() - 1e-9


def test_round_to_budget_ties_and_edges():
    np.testing.assert_array_equal(fo.round_to_budget(np.ones(3), 4), [2, 1, 1])
    np.testing.assert_array_equal(fo.round_to_budget(np.ones(3), 2), [1, 1, 0])
    np.testing.assert_array_equal(fo.round_to_budget(np.array([0.0, 1.0, 0.0, 1.0]), 3), [0, 2, 0, 1])
    np.testing.assert_array_equal(fo.round_to_budget(np.zeros(4), 7), [7, 0, 0, 0])
    np.testing.assert_array_equal(fo.round_to_budget(np.array([0.2, 0.3, 0.5]), 0), [0, 0, 0])
    np.testing.assert_array_equal(fo.round_to_budget(np.array([3.0, 1.0]), 8), [6, 2])
    np.testing.assert_array_equal(fo.round_to_budget(np.array([5e-324, 5e-324, 1e-323]), 4), [1, 1, 2])
    with pytest.raises(ValueError):
        fo.round_to_budget(np.array([1.0, -0.5]), 3)
    with pytest.raises(ValueError):
        fo.round_to_budget(np.array([1.0, np.nan]), 3)


# --- geometric fan-out (Theorem 12) ------------------------------------------------------------
@FAST
@given(st.floats(0.0, 1.0), st.floats(0.0, 10.0), st.integers(0, 16), st.integers(0, 300))
def test_geometric_fanout_sums_and_tracks_the_real_schedule(a, r, K, budget):
    F = fo.geometric_fanout(a, r, K, budget)
    assert F.shape == (K + 1,) and F.dtype == np.int64
    assert F.sum() == budget and np.all(F >= 0)
    real = fo.geometric_fanout_real(a, r, K, budget)
    assert np.isclose(real.sum(), budget)
    assert np.all(np.abs(F - real) < 1.0 + 1e-9)


@pytest.mark.parametrize("a,r,K", [(0.9, 0.5, 7), (0.6, 0.3, 5), (0.3, 1.0, 4), (0.8, 0.4, 1)])
def test_geometric_proportions_match_theorem_12(a, r, K):
    real = fo.geometric_fanout_real(a, r, K, 100.0)
    # the paper's closed form: F_k = F_0 a^(k/(1+r)) for k < K, F_K = F_0 a^(K/(1+r)) (1-a)^(-1/(1+r))
    k = np.arange(K)
    np.testing.assert_allclose(real[:K] / real[0], a ** (k / (1 + r)), rtol=1e-12)
    np.testing.assert_allclose(real[K] / real[0], a ** (K / (1 + r)) * (1 - a) ** (-1 / (1 + r)), rtol=1e-12)
    # F_k ∝ P(k)^(1/(1+r)) with the capped-geometric P
    P = fo.capped_geometric_pmf(a, K)
    assert np.isclose(P.sum(), 1.0)
    np.testing.assert_allclose(real / real.sum(), P ** (1 / (1 + r)) / np.sum(P ** (1 / (1 + r))), rtol=1e-12)


def test_high_acceptance_gives_the_all_accepted_bucket_the_most():
    real = fo.geometric_fanout_real(0.9, 0.5, 7, 1.0)
    assert int(np.argmax(real)) == 7
    assert real[7] / real[0] == pytest.approx(2.84, abs=0.01)  # docs/reference.md §4: ≈2.84·F_0
    F = fo.geometric_fanout(0.9, 0.5, 7, 24)
    assert int(np.argmax(F)) == 7 and F[7] > F[0]


def test_low_acceptance_puts_the_most_on_k0():
    F = fo.geometric_fanout(0.1, 0.4, 7, 24)
    assert int(np.argmax(F)) == 0 and F[0] > 12
    assert np.all(np.diff(F[:7]) <= 0)


def test_real_schedule_maximises_the_modelled_hit_rate():
    """Theorem 12 is an optimum: moving budget between buckets can only lower the hit rate."""
    rng = np.random.default_rng(0)
    for a, r, K in [(0.8, 0.5, 4), (0.5, 0.3, 3), (0.95, 0.4, 6)]:
        budget = 40.0 * (K + 1)  # large enough that every F_k >= 1 (c F^-r <= 1, no clipping)
        best = fo.geometric_fanout_real(a, r, K, budget)
        assert best.min() >= 1.0
        h_best = fo.predicted_hit_rate(best, a, r, c=1.0)
        for _ in range(200):
            i, j = rng.choice(K + 1, size=2, replace=False)
            d = rng.uniform(0.01, 0.5) * (best[i] - 1.0)
            moved = best.copy()
            moved[i] -= d
            moved[j] += d
            assert fo.predicted_hit_rate(moved, a, r, c=1.0) < h_best
        assert h_best > fo.predicted_hit_rate(np.full(K + 1, budget / (K + 1)), a, r, c=1.0)


def test_parameters_are_clipped():
    np.testing.assert_array_equal(
        fo.geometric_fanout(1.0, 0.4, 7, 24), fo.geometric_fanout(1 - 1e-3, 0.4, 7, 24)
    )
    np.testing.assert_array_equal(fo.geometric_fanout(0.0, 0.4, 7, 24), fo.geometric_fanout(1e-3, 0.4, 7, 24))
    np.testing.assert_array_equal(fo.geometric_fanout(0.7, 99.0, 7, 24), fo.geometric_fanout(0.7, 5.0, 7, 24))
    np.testing.assert_array_equal(fo.geometric_fanout(0.7, 0.0, 7, 24), fo.geometric_fanout(0.7, 0.01, 7, 24))
    assert np.all(np.isfinite(fo.geometric_fanout_real(1e-3, 0.01, 200, 10.0)))


def test_uniform_fanout():
    np.testing.assert_array_equal(fo.uniform_fanout(3, 7), np.full(8, 3))
    assert fo.uniform_fanout(3, 7).sum() == 24


# --- branch layout ------------------------------------------------------------------------------
def test_branch_layout_by_hand():
    k, rank = fo.branch_layout(np.array([[2, 0, 1], [1, 1, 1], [0, 0, 0]]), 4)
    assert k.dtype == np.int32 and rank.dtype == np.int32 and k.shape == (3, 4)
    np.testing.assert_array_equal(k, [[0, 0, 2, -1], [0, 1, 2, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(rank, [[0, 1, 0, -1], [0, 0, 0, -1], [-1, -1, -1, -1]])
    with pytest.raises(ValueError):
        fo.branch_layout(np.array([[2, 2, 1]]), 4)


@FAST
@given(st.integers(1, 5), st.integers(0, 8), st.integers(0, 40), st.data())
def test_branch_layout_enumerates_exactly(B, K, budget, data):
    rows = []
    for _ in range(B):
        total = data.draw(st.integers(0, budget))
        w = np.array(data.draw(st.lists(st.floats(0, 1), min_size=K + 1, max_size=K + 1)))
        rows.append(fo.round_to_budget(w, total))
    fan = np.stack(rows)
    k, rank = fo.branch_layout(fan, budget)
    assert k.shape == rank.shape == (B, budget) and k.dtype == rank.dtype == np.int32
    for b in range(B):
        n = int(fan[b].sum())
        expect_k = np.repeat(np.arange(K + 1), fan[b])
        expect_rank = np.concatenate([np.arange(f) for f in fan[b]]) if n else np.zeros(0)
        np.testing.assert_array_equal(k[b, :n], expect_k)
        np.testing.assert_array_equal(rank[b, :n], expect_rank)
        assert np.all(k[b, n:] == -1) and np.all(rank[b, n:] == -1)
        # each (k, rank) pair appears once, and bucket k holds exactly F[b, k] branches
        np.testing.assert_array_equal(np.bincount(k[b, :n], minlength=K + 1), fan[b])


# --- estimator ----------------------------------------------------------------------------------
def test_estimator_priors_and_schedules():
    est = fo.FanoutEstimator(K=7, budget=24)
    assert est.a == pytest.approx(0.7) and est.a_post == pytest.approx(0.05) and est.r == pytest.approx(0.4)
    np.testing.assert_array_equal(est.schedule(), fo.geometric_fanout(0.7, 0.4, 7, 24))
    post = est.schedule(post_miss=True)
    assert post.sum() == 24 and post[0] == post.max() and post[0] > 24 * 0.75
    d = est.to_dict()
    json.dumps(d)
    assert d["a"] == pytest.approx(0.7) and sum(d["schedule"]) == 24 and d["c"] is None


def test_uniform_mode():
    est = fo.FanoutEstimator(K=7, budget=24, mode="uniform", uniform_F=3)
    np.testing.assert_array_equal(est.schedule(), np.full(8, 3))
    np.testing.assert_array_equal(est.schedule(post_miss=True), np.full(8, 3))
    with pytest.raises(ValueError):
        fo.FanoutEstimator(K=7, budget=25, mode="uniform", uniform_F=3)
    with pytest.raises(ValueError):
        fo.FanoutEstimator(K=7, budget=24, mode="uniform")
    with pytest.raises(ValueError):
        fo.FanoutEstimator(K=7, budget=24, mode="tree")


def test_acceptance_estimate_is_the_capped_geometric_mle_with_pseudo_counts():
    est = fo.FanoutEstimator(K=7, budget=16, a0=0.7, prior_weight=8.0)
    fan = np.tile(fo.uniform_fanout(2, 7), (5, 1))
    # rows 0-2 normal: k=2 of 7 (2 succ, 1 fail), 7 of 7 (7, 0), 3 of 3 (3, 0: capped by n_draft)
    # rows 3-4 post-miss: k=0 of 7 (0, 1), 1 of 7 (1, 1)
    est.observe(
        np.array([2, 7, 3, 0, 1]),
        np.array([7, 7, 3, 7, 7]),
        np.zeros(5, bool),
        fan,
        np.array([False, False, False, True, True]),
    )
    assert est.a == pytest.approx((12 + 8 * 0.7) / (13 + 8))
    assert est.a_post == pytest.approx((1 + 8 * 0.05) / (3 + 8))
    with pytest.raises(ValueError):
        est.observe(np.array([4]), np.array([3]), np.array([False]), fan[:1], np.array([False]))
    est.observe(
        np.zeros(0, int), np.zeros(0, int), np.zeros(0, bool), np.zeros((0, 8), int), np.zeros(0, bool)
    )


def test_r_keeps_the_prior_without_two_fanout_values():
    est = fo.FanoutEstimator(K=3, budget=8, mode="uniform", uniform_F=2, r0=0.4)
    rng = np.random.default_rng(1)
    n = 2000
    est.observe(
        rng.integers(0, 4, n),
        np.full(n, 3),
        rng.random(n) < 0.5,
        np.tile(est.schedule(), (n, 1)),
        np.zeros(n, bool),
    )
    assert est.r == pytest.approx(0.4)


def _capped_geometric(rng, a, K):
    return np.minimum(rng.geometric(1.0 - a) - 1, K)


def test_estimator_converges_on_synthetic_rounds():
    """Closed loop: outcomes from a capped geometric (a=0.8; 0.05 after fast fallbacks), misses c·F^-r."""
    K, budget, B, a_true, r_true, c_true = 7, 24, 8, 0.8, 0.5, 0.7
    rng = np.random.default_rng(0)
    est = fo.FanoutEstimator(K=K, budget=budget, a0=0.6, r0=0.3)
    for _ in range(500):  # 4000 rows
        post = rng.random(B) < 0.15
        fan = np.where(post[:, None], est.schedule(post_miss=True)[None], est.schedule()[None])
        k = _capped_geometric(rng, np.where(post, 0.05, a_true), K)
        F = fan[np.arange(B), k]
        miss = np.where(F >= 1, np.minimum(1.0, c_true * np.maximum(F, 1) ** -r_true), 1.0)
        est.observe(k, np.full(B, K), rng.random(B) >= miss, fan, post)
    assert abs(est.a - a_true) < 0.03
    assert abs(est.a_post - 0.05) < 0.03
    assert abs(est.r - r_true) < 0.15
    assert abs(est.c - c_true) < 0.15
    sched = est.schedule()
    assert sched.sum() == budget and int(np.argmax(sched)) in (0, K)
    d = est.to_dict()
    json.dumps(d)
    assert d["rows_observed"] + d["rows_observed_post_miss"] == 4000


# --- speedup model and backup choice (Theorem 7 / Corollary 16) ----------------------------------
def test_predicted_speedup_by_hand():
    # num = 0.8*5 + 0.2*3 = 4.6; q = 0.8^2 = 0.64; den = 0.64*max(1, 0.5) + 0.36*(1 + 0.3) = 1.108
    assert fo.predicted_speedup(0.8, 5.0, 3.0, 0.5, 0.3, 2) == pytest.approx(4.6 / 1.108, rel=1e-12)
    # primary slower than the verify pass: max(1, T_p) = 1.5; batch 1 is Theorem 7
    assert fo.predicted_speedup(0.5, 4.0, 2.0, 1.5, 1.0, 1) == pytest.approx(3.0 / (0.75 + 1.0), rel=1e-12)
    # always hitting, cache built within the verify pass: E_hit per target pass
    assert fo.predicted_speedup(1.0, 5.5, 0.0, 0.7, 9.0, 64) == pytest.approx(5.5)


def test_critical_batch_size():
    kw = dict(e_hit=5.0, e_miss_neural=3.0, e_miss_fast=1.0, t_primary=0.9, t_fast=0.01)
    # a slow neural backup loses almost at once at p_hit = 0.8
    assert fo.critical_batch_size(0.8, t_neural=1.0, **kw) <= 2
    # a free neural backup always wins (better proposals, no extra time)
    assert fo.critical_batch_size(0.8, t_neural=0.0, **kw) == 4097
    assert fo.critical_batch_size(0.8, t_neural=0.0, b_max=10, **kw) == 11
    # b* does not grow as the neural backup gets slower
    bs = [fo.critical_batch_size(0.9, t_neural=t, **kw) for t in (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)]
    assert all(x >= y for x, y in zip(bs, bs[1:])) and bs[0] > bs[-1]
    # rarer hits mean more rounds on the (poor) fast proposals: b* grows, until the fast backup never pays
    bs = [fo.critical_batch_size(p, t_neural=0.2, **kw) for p in (0.5, 0.7, 0.8, 0.9)]
    assert all(x >= y for x, y in zip(bs, bs[1:])) and bs[0] == 4097 and bs[-1] < 10


@pytest.mark.parametrize("p_hit,t_neural", [(0.9, 0.2), (0.95, 0.3), (0.8, 0.15), (0.99, 0.5)])
def test_choose_backup_switches_once_at_the_critical_batch(p_hit, t_neural):
    kw = dict(e_hit=5.0, e_miss_neural=3.0, e_miss_fast=0.5, t_primary=0.9, t_neural=t_neural, t_fast=0.0)
    b_star = fo.critical_batch_size(p_hit, **kw)
    assert 1 < b_star <= 4096  # a real crossing in these settings
    choices = [fo.choose_backup(b, p_hit, **kw) for b in range(1, b_star + 20)]
    assert choices == ["neural"] * (b_star - 1) + ["fast"] * 20
    s = lambda b, e_miss, t_b: fo.predicted_speedup(p_hit, 5.0, e_miss, 0.9, t_b, b)
    assert s(b_star, 0.5, 0.0) >= s(b_star, 3.0, t_neural)
    assert s(b_star - 1, 0.5, 0.0) < s(b_star - 1, 3.0, t_neural)
