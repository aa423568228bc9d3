"""Speculative verification (ssd_jax.verify): greedy rules, analytic exactness, Monte Carlo exactness.

The Monte Carlo tests compare the empirical distribution of the first emitted tokens with the
exact target distribution by a chi-square test at significance 1e-6 each (threshold from the
Wilson-Hilferty approximation, which is conservative here: checked against the exact
incomplete gamma function, the true tail mass at the approximate quantile is 2.7e-7..9.9e-7
< 1e-6 for df 2..1000; cells with expected count < 5 are pooled). Seeds are fixed, so the outcome is
deterministic; the family-wise false-positive rate over the whole file (24 chi-square tests
that must pass) is below 2.5e-5 by the union bound.
Negative controls (deliberately wrong verifiers) must FAIL the same test: that shows the test
has the power to catch the bug classes it is meant for.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssd_jax.sampling.filters import RowSampling, SamplingParams, filter_logprobs, sample
from ssd_jax.sampling.rejection import (
    VerifyResult,
    acceptance_prob,
    emitted_tokens,
    expected_acceptance,
    is_key_batch,
    mark_point_mass,
    residual_distribution,
    row_keys,
    verify,
    verify_greedy,
)

verify_jit = jax.jit(verify, static_argnums=(5,))


def _rs(temps, top_k=None, top_p=None) -> RowSampling:
    temps = np.asarray(temps, np.float32)
    B = temps.shape[0]
    return RowSampling(
        temperature=jnp.asarray(temps),
        top_k=jnp.asarray(np.zeros(B, np.int32) if top_k is None else np.asarray(top_k, np.int32)),
        top_p=jnp.asarray(np.ones(B, np.float32) if top_p is None else np.asarray(top_p, np.float32)),
    )


# ============================================================================ 1. greedy


def _greedy_case():
    """B=5, K=3, V=6 logits with a known argmax per position, and a tie at row 4."""
    B, K, V = 5, 3, 6
    am = np.array([[1, 2, 3, 4], [5, 0, 1, 2], [3, 3, 3, 3], [2, 4, 0, 1], [2, 1, 0, 5]])
    logits = np.random.default_rng(0).normal(size=(B, K + 1, V)).astype(np.float32)
    for b in range(B):
        for j in range(K + 1):
            logits[b, j, am[b, j]] = 10.0
    # Row 4, position 0: ids 2 and 4 tie for the max -> argmax is the lowest id, 2.
    logits[4, 0, 4] = 10.0
    drafts = np.array(
        [
            [1, 2, 3],  # all match, n_draft 3 -> accept 3, bonus argmax at 3
            [5, 1, 1],  # mismatch at 1 -> accept 1, correction argmax at 1
            [3, 3, 3],  # all would match but n_draft 1 -> accept 1, bonus argmax at 1
            [-1, -1, -1],  # n_draft 0 (padding ids) -> accept 0, token argmax at 0
            [4, 1, 0],  # tie: 4 is not the (lowest-id) argmax -> reject at 0, emit 2
        ],
        np.int32,
    )
    n_draft = np.array([3, 3, 1, 0, 3], np.int32)
    want_n = np.array([3, 1, 1, 0, 0])
    want_next = np.array([4, 0, 3, 2, 2])
    return logits, drafts, n_draft, want_n, want_next


class GreedyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_greedy_rules(self):
        logits, drafts, n_draft, want_n, want_next = _greedy_case()
        B, Kp1, _ = logits.shape
        fn = self.variant(verify, static_argnums=(5,))
        rs = _rs(np.zeros(B))
        res = fn(jax.random.key(0), logits, drafts, n_draft, rs, False)
        chex.assert_shape([res.n_accepted, res.next_token], (B,))
        chex.assert_shape(res.accepted_BxK, (B, Kp1 - 1))
        chex.assert_type([res.n_accepted, res.next_token], jnp.int32)
        np.testing.assert_array_equal(res.n_accepted, want_n)
        np.testing.assert_array_equal(res.next_token, want_next)
        want_acc = np.arange(Kp1 - 1)[None, :] < want_n[:, None]
        np.testing.assert_array_equal(res.accepted_BxK, want_acc)

    def test_greedy_tie_matches_ar_sampler(self):
        logits, *_ = _greedy_case()
        ar = sample(jax.random.key(0), jnp.asarray(logits[:, 0]), _rs(np.zeros(5)), False)
        self.assertEqual(int(ar[4]), 2)  # the tie is resolved exactly as verify does

    def test_emitted_tokens(self):
        _, drafts, _, want_n, want_next = _greedy_case()
        res = VerifyResult(jnp.asarray(want_n, jnp.int32), jnp.asarray(want_next, jnp.int32), None)
        em = np.asarray(emitted_tokens(jnp.asarray(drafts), res))
        assert em.shape == (5, 4)
        assert em[0].tolist() == [1, 2, 3, 4]
        assert em[1].tolist() == [5, 0, -1, -1]
        assert em[2].tolist() == [3, 3, -1, -1]
        assert em[3].tolist() == [2, -1, -1, -1]
        assert em[4].tolist() == [2, -1, -1, -1]


def test_no_proposals_is_an_ar_step():
    """K = 0 and n_draft = 0 rows both reduce to one draw from p at position 0."""
    B, V = 3, 5
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(B, 1, V)), jnp.float32)
    rs = _rs([0.0, 1.0, 0.5])
    res = verify_jit(
        jax.random.key(3), logits, jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32), rs, False
    )
    chex.assert_shape(res.accepted_BxK, (B, 0))
    np.testing.assert_array_equal(res.n_accepted, 0)
    assert int(res.next_token[0]) == int(jnp.argmax(logits[0, 0]))


@pytest.mark.parametrize("K", [0, 1, 4])
def test_greedy_verify_equals_verify_on_greedy_rows(K):
    """The all-greedy program's verify gives exactly what :func:`verify` gives greedy rows: accept counts,
    next tokens and the accepted mask, for every n_draft and with proposals that match the argmax
    for a while (so every accept count occurs) or carry padding past n_draft."""
    B, V = 64, 11
    rng = np.random.default_rng(K)
    logits = jnp.asarray(rng.normal(size=(B, K + 1, V)), jnp.float32)
    amax = np.asarray(jnp.argmax(logits, axis=-1))
    s = np.where(rng.random((B, K)) < 0.7, amax[:, :K], rng.integers(0, V, (B, K)))  # mostly the argmax
    n_draft = rng.integers(0, K + 1, B)
    s = np.where(np.arange(K)[None] < n_draft[:, None], s, -1)  # padding past n_draft
    q = jnp.asarray(np.log(rng.dirichlet(np.ones(V), (B, K))), jnp.float32)
    full = verify_jit(
        jax.random.key(0), logits, jnp.asarray(s, jnp.int32), jnp.asarray(n_draft), _rs([0.0] * B), False, q
    )
    g = jax.jit(verify_greedy)(logits, jnp.asarray(s, jnp.int32), jnp.asarray(n_draft))
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(g)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if K:
        assert len(set(np.asarray(g.n_accepted).tolist())) > 1


def test_point_mass_with_p_one_is_always_accepted_and_zero_never():
    B, K, V = 2, 2, 4
    logits = np.full((B, K + 1, V), -np.inf, np.float32)
    logits[:, :K, 1] = 0.0  # p = delta_1 at the proposals' positions ...
    logits[:, K, 3] = 0.0  # ... and delta_3 at position K (the bonus after K acceptances)
    drafts = np.array([[1, 1], [2, 1]], np.int32)
    rs = _rs([1.0, 1.0])
    for seed in range(5):
        res = verify_jit(jax.random.key(seed), logits, drafts, np.array([2, 2], np.int32), rs, False)
        assert res.n_accepted.tolist() == [2, 0]
        assert res.next_token.tolist() == [3, 1]


def test_key_kinds():
    assert row_keys(jax.random.key(0), 3).shape == (3,)
    assert not is_key_batch(jax.random.PRNGKey(0)) and not is_key_batch(jax.random.key(0))
    assert is_key_batch(jax.random.split(jax.random.PRNGKey(0), 3))
    assert is_key_batch(jax.random.split(jax.random.key(0), 3))
    B, K, V = 4, 3, 7
    with pytest.raises(ValueError, match="row keys"):
        verify(
            jax.random.split(jax.random.key(0), B + 1),
            jnp.zeros((B, K + 1, V)),
            jnp.zeros((B, K), jnp.int32),
            jnp.full((B,), K),
            _rs(np.ones(B)),
            False,
        )


# ============================================================================ 2. analytic properties


VH = 10  # one vocabulary size for all property tests (one compilation); zeros vary the support


@jax.jit
def _q_rule(p, q):
    """Everything the q-rule property test checks, in one compiled call."""
    a = acceptance_prob(jnp.broadcast_to(p, (VH, VH)), jnp.broadcast_to(q, (VH, VH)), jnp.arange(VH))
    r = residual_distribution(p, q)
    alpha = expected_acceptance(p, q)
    # P(first emitted = x) = q(x) a(x) + P(reject) r(x), with s ~ q.
    out = q * a + (1.0 - jnp.sum(q * a)) * r
    return out, a, r, alpha


@jax.jit
def _point_rule(p, q, s):
    """Point-mass proposal s: emitted distribution, acceptance, and acceptance when q(s) = 0."""
    a = acceptance_prob(p, None, s)
    delta = jax.nn.one_hot(s, VH, dtype=jnp.float32)
    out = a * delta + (1.0 - a) * residual_distribution(p, delta)
    a_q0 = acceptance_prob(p, q.at[s].set(0.0), s)
    return out, a, a_q0


_filter_jit = jax.jit(lambda x, rs: filter_logprobs(x, rs, True))


@st.composite
def _dist(draw):
    """A float32 distribution on VH tokens with zeros from top-k / top-p (filter_logprobs) and a random mask."""
    logits = np.array(draw(st.lists(st.floats(-6, 6), min_size=VH, max_size=VH)), np.float32)
    temp = draw(st.sampled_from([1.0, 0.7, 1.5]))
    k = draw(st.integers(0, VH))
    top_p = draw(st.sampled_from([1.0, 1.0, 0.9, 0.5]))
    mask = np.array(draw(st.lists(st.booleans(), min_size=VH, max_size=VH)))
    if mask.all():
        mask[draw(st.integers(0, VH - 1))] = False
    logits = np.where(mask, -np.inf, logits).astype(np.float32)
    rs = _rs([temp], [k], [top_p])
    return np.array(jnp.exp(_filter_jit(jnp.asarray(logits)[None], rs)[0]))


_settings = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(_dist(), _dist())
def test_q_rule_is_exact_analytically(p, q):
    out, a, r, alpha = (np.asarray(x) for x in _q_rule(jnp.asarray(p), jnp.asarray(q)))
    assert np.all((a >= 0) & (a <= 1))
    assert np.all(r >= 0) and abs(r.sum() - 1) < 1e-5
    assert -1e-6 <= alpha <= 1 + 1e-6
    np.testing.assert_allclose(alpha, np.sum(q * a), atol=1e-5)  # α = E_{s~q}[accept]
    np.testing.assert_allclose(out, p, atol=1e-5)


@_settings
@given(_dist(), _dist(), st.integers(0, VH - 1))
def test_point_mass_rule_is_exact_analytically(p, q, s):
    out, a, a_q0 = (np.asarray(x) for x in _point_rule(jnp.asarray(p), jnp.asarray(q), jnp.asarray(s)))
    assert 0 <= a <= 1
    np.testing.assert_allclose(out, p, atol=1e-5)
    # A proposal the draft "could not sample" (q(s) = 0) is verified as a point mass.
    assert a_q0 == a


def test_residual_falls_back_to_p():
    p = jnp.array([0.5, 0.5, 0.0], jnp.float32)
    np.testing.assert_allclose(residual_distribution(p, p), p)
    np.testing.assert_allclose(residual_distribution(p, jnp.array([0.6, 0.6, 0.0])), p)
    np.testing.assert_allclose(residual_distribution(p, jnp.array([1.0, 0.0, 0.0])), [0, 1, 0])


# ============================================================================ 3. Monte Carlo exactness

V = 8
_rng = np.random.default_rng(7)
# Bigram "models": logits of the next token = table[previous token]. Broad enough that top-p 0.9 at
# T 0.7 keeps >= 6 of 8 tokens per context (37 two-token sequences after C0); draft/target α ≈ 0.6-0.7.
TT = (_rng.normal(size=(V, V)) * 0.7).astype(np.float32)
TD = (TT + _rng.normal(size=(V, V))).astype(np.float32)
C0 = 0  # the context token before the first round

# Draft modes of the simulator (traced, so one compilation serves them all).
Q, Q_NOFILTER, DRAFT_NOFILTER, FIXED, RANDOM = range(5)


def _biased_verify(key, tl, drafts, n_draft, rs, needs_filter, lq=None):
    """NEGATIVE CONTROL: accept a proposal iff it is the target argmax, then sample p (not exact at T > 0)."""
    Kp1 = tl.shape[1]
    logp = filter_logprobs(tl, rs, needs_filter)
    ok = (drafts == jnp.argmax(logp[:, :-1], -1)) & (jnp.arange(Kp1 - 1)[None] < n_draft[:, None])
    acc = jnp.cumprod(ok.astype(jnp.int32), 1).astype(bool)
    n = acc.sum(1, dtype=jnp.int32)
    lp_n = jnp.take_along_axis(logp, n[:, None, None], axis=1)[:, 0]
    nxt = jax.random.categorical(key, lp_n).astype(jnp.int32)
    return VerifyResult(n_accepted=n, next_token=nxt, accepted_BxK=acc)


@functools.partial(jax.jit, static_argnames=("K", "n_tok", "needs_filter"))
def _simulate(key, rs, mode, rand_ndraft, biased, *, K=3, n_tok=3, needs_filter=True):
    """Run SD rounds on N independent rows (N = batch) and return each row's first n_tok tokens.

    The "models" are bigram tables: logits of the next token = table[previous token].
    mode: Q the draft samples from filter(TD) and the verifier gets that q;
          Q_NOFILTER same draft, but the verifier gets q without top-k/top-p (control);
          DRAFT_NOFILTER the draft samples without top-k/top-p, the verifier gets filtered q (control);
          FIXED a deterministic bigram proposal (n-gram-like point mass);
          RANDOM uniformly random point-mass proposals.
    Point-mass modes mark every position with mark_point_mass (equivalent to draft_logprobs=None,
    see test_point_mass_marking_equals_none).
    rand_ndraft: each row proposes a uniform number 0..K of tokens per round (else K).
    biased: use the _biased_verify negative control instead of verify.
    Everything but shapes is traced: XLA's CPU compiler is slow (seconds per program), so all
    Monte Carlo cases share ONE compilation.
    """
    tt, td = jnp.asarray(TT), jnp.asarray(TD)
    N = rs.temperature.shape[0]
    slots = jnp.arange(n_tok)[None, :]

    def draft_step(carry, kj):
        prev = carry
        dl = td[prev]
        # The filtered q (what the draft should sample from and report) and the same without
        # top-k / top-p (temperature only) for the two mismatch modes; sampling as in
        # ssd_jax.sampling.sample (argmax for greedy rows, else a draw from the log-probs).
        lq_f = filter_logprobs(dl, rs, needs_filter)
        lq_u = filter_logprobs(dl, rs, False)
        lq_draw = jnp.where(mode == DRAFT_NOFILTER, lq_u, lq_f)
        s_q = jnp.where(rs.temperature > 0, jax.random.categorical(kj, lq_draw), jnp.argmax(dl, -1))
        s_rand = jax.random.randint(jax.random.fold_in(kj, 1), (N,), 0, V)
        s = jnp.where(mode == FIXED, (prev * 3 + 1) % V, jnp.where(mode == RANDOM, s_rand, s_q))
        return s.astype(jnp.int32), (s.astype(jnp.int32), jnp.where(mode == Q_NOFILTER, lq_u, lq_f))

    def round_(r, state):
        ctx, out, filled = state
        kd, kn, kv = jax.random.split(jax.random.fold_in(key, r), 3)
        _, (drafts, lq) = jax.lax.scan(draft_step, ctx, jax.random.split(kd, K))
        drafts, lq = drafts.T, jnp.swapaxes(lq, 0, 1)  # (N, K), (N, K, V)
        lq = mark_point_mass(lq, jnp.broadcast_to(mode >= FIXED, drafts.shape))
        tl = tt[jnp.concatenate([ctx[:, None], drafts], 1)]  # (N, K+1, V)
        n_draft = jnp.where(rand_ndraft, jax.random.randint(kn, (N,), 0, K + 1), K)
        res = jax.tree.map(
            lambda a, b: jnp.where(biased, a, b),
            _biased_verify(kv, tl, drafts, n_draft, rs, needs_filter, lq),
            verify(kv, tl, drafts, n_draft, rs, needs_filter, lq),
        )
        em = emitted_tokens(drafts, res)
        for j in range(K + 1):
            w = (j <= res.n_accepted)[:, None] & (slots == (filled + j)[:, None])
            out = jnp.where(w, em[:, j : j + 1], out)
        return res.next_token, out, filled + res.n_accepted + 1

    init = (jnp.full((N,), C0, jnp.int32), jnp.full((N, n_tok), -1, jnp.int32), jnp.zeros((N,), jnp.int32))
    return jax.lax.fori_loop(0, n_tok, round_, init)[1]  # every round emits >= 1 token


def _exact_dist(rs1: RowSampling, needs_filter: bool, n_tok: int) -> np.ndarray:
    """P(first n_tok tokens) under the target, by enumeration (flattened, base-V index)."""
    rsV = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], (V,)), rs1)
    pt = np.exp(np.asarray(filter_logprobs(jnp.asarray(TT), rsV, needs_filter), np.float64))
    pt /= pt.sum(1, keepdims=True)
    dist = pt[C0]
    for _ in range(n_tok - 1):
        dist = (dist.reshape(-1, V)[..., None] * pt[None]).reshape(-1)
    return dist


CHI2_Z = 4.753424308828307  # standard normal upper quantile at 1e-6


def _chi2_threshold(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square upper quantile at 1e-6 (conservative here)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + CHI2_Z * np.sqrt(c)) ** 3


def _chi2(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, threshold); cells with expected count < 5 are pooled; any hit on a p = 0 cell is fatal."""
    N, n_tok = tokens.shape
    assert (tokens >= 0).all() and (tokens < V).all()
    idx = np.zeros(N, np.int64)
    for t in range(n_tok):
        idx = idx * V + tokens[:, t]
    obs = np.bincount(idx, minlength=V**n_tok).astype(np.float64)
    expct = N * probs / probs.sum()
    zero = probs <= 0
    if obs[zero].sum() > 0:
        return np.inf, 0.0
    big = (expct >= 5) & ~zero
    small = ~big & ~zero
    o = list(obs[big])
    e = list(expct[big])
    if small.any():
        o.append(obs[small].sum())
        e.append(expct[small].sum())
    o, e = np.array(o), np.array(e)
    stat = float(np.sum((o - e) ** 2 / e))
    return stat, _chi2_threshold(len(o) - 1)


N_MC = 20_000  # rows = independent draws; every case has the same shapes (one compilation)
SETTINGS = {  # needs_filter is True throughout (rows with top_k 0 / top_p 1 are unfiltered)
    "t1": {"temperature": 1.0},
    "t07_p09": {"temperature": 0.7, "top_p": 0.9},
    "t13_k4": {"temperature": 1.3, "top_k": 4},
}


def _two_and_three(toks: np.ndarray, rs1: RowSampling) -> tuple[tuple[float, float], tuple[float, float]]:
    """Chi-square (stat, threshold) for the first two tokens and for the first three."""
    return _chi2(toks[:, :2], _exact_dist(rs1, True, 2)), _chi2(toks, _exact_dist(rs1, True, 3))


def _run(setting, mode, seed, biased=False, rand_ndraft=False):
    rs = RowSampling.broadcast(SamplingParams(**SETTINGS[setting]), N_MC)
    toks = _simulate(jax.random.key(seed), rs, mode, rand_ndraft, biased)
    return _two_and_three(np.asarray(toks), rs)


@pytest.mark.parametrize(
    "setting,mode,rand_ndraft",
    [
        ("t1", Q, False),
        ("t1", Q, True),
        ("t1", FIXED, True),
        ("t1", RANDOM, False),
        ("t07_p09", Q, False),
        ("t07_p09", Q, True),
        ("t07_p09", FIXED, False),
        ("t07_p09", RANDOM, True),
        # The draft sampled WITHOUT top-p but the verifier was given the filtered q: still exact,
        # because tokens outside q's support (q(s) = 0) fall back to the point-mass rule and,
        # restricted to the support, the unfiltered draft is distributed exactly as q.
        ("t07_p09", DRAFT_NOFILTER, False),
        ("t13_k4", Q, True),
    ],
)
def test_monte_carlo_exact(setting, mode, rand_ndraft):
    (stat2, thr2), (stat3, thr3) = _run(setting, mode, seed=11, rand_ndraft=rand_ndraft)
    assert stat2 < thr2, (stat2, thr2)
    assert stat3 < thr3, (stat3, thr3)  # also the third token (position 2 / bonus at n_draft 2)


@pytest.mark.parametrize(
    "setting,mode,biased",
    [
        ("t1", Q, True),  # (i) accept iff argmax, with model drafts
        ("t07_p09", Q, True),
        ("t07_p09", RANDOM, True),  # (i) with point-mass drafts
        ("t07_p09", Q_NOFILTER, False),  # (ii) verifier sees q without top-p, draft sampled filtered
    ],
)
def test_monte_carlo_negative_controls_fail(setting, mode, biased):
    (stat2, thr2), _ = _run(setting, mode, seed=11, biased=biased)
    assert stat2 > thr2, (stat2, thr2)


# ============================================================================ 4. mixed batch


def test_mixed_batch_each_row_follows_its_settings():
    """Rows cycle greedy / T=1 / T=0.7 top-p 0.9 in ONE batch: each group has its own exact law."""
    n = N_MC
    group = np.arange(n) % 3
    rs = _rs(np.array([0.0, 1.0, 0.7], np.float32)[group], np.zeros(n), np.array([1.0, 1.0, 0.9])[group])
    toks = np.asarray(_simulate(jax.random.key(5), rs, Q, False, False))
    chain = [C0]
    for _ in range(toks.shape[1]):
        chain.append(int(np.argmax(TT[chain[-1]])))
    assert (toks[group == 0] == np.array(chain[1:])).all()  # greedy SD == greedy AR
    for g, setting in ((1, "t1"), (2, "t07_p09")):
        rs1 = RowSampling.broadcast(SamplingParams(**SETTINGS[setting]), 1)
        (stat2, thr2), (stat3, thr3) = _two_and_three(toks[group == g], rs1)
        assert stat2 < thr2 and stat3 < thr3, (setting, stat2, thr2, stat3, thr3)


def _row_case(seed):
    """B=6, K=4, V=9: greedy and sampled rows with top-k / top-p, some point-mass positions."""
    B, K, Vb = 6, 4, 9
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(B, K + 1, Vb)) * 2).astype(np.float32)
    drafts = rng.integers(0, Vb, size=(B, K)).astype(np.int32)
    drafts[0] = np.argmax(logits[0, :K], -1)  # a greedy row that accepts some: argmax, then a miss
    drafts[0, 2] = (drafts[0, 2] + 1) % Vb
    nd = np.array([4, 3, 0, 4, 2, 4], np.int32)
    rs = _rs([0.0, 1.0, 0.7, 1.3, 0.0, 0.5], [0, 0, 3, 0, 0, 2], [1.0, 0.8, 1.0, 0.9, 1.0, 1.0])
    x = np.where(rng.random((B, K, Vb)) < 0.3, -np.inf, rng.normal(size=(B, K, Vb)))  # q with zeros
    x[..., 0] = 0.0
    lq = x - np.log(np.exp(x).sum(-1, keepdims=True))
    lq = np.where((rng.random((B, K)) < 0.3)[..., None], -np.inf, lq).astype(np.float32)  # point masses
    return logits, drafts, nd, rs, lq


def _greedy_reference(logits, drafts, nd):
    am = np.argmax(logits, -1)
    n = 0
    while n < nd and drafts[n] == am[n]:
        n += 1
    return n, am[n]


def test_row_result_depends_only_on_its_own_row():
    """With per-row keys, permuting the batch permutes the results, and replacing the other rows
    (content and sampling settings) leaves a row unchanged; greedy rows follow the argmax rule
    whatever the filter flag, key or draft distribution."""
    logits, drafts, nd, rs, lq = _row_case(9)
    keys = jax.random.split(jax.random.key(42), 6)
    whole = verify_jit(keys, logits, drafts, nd, rs, True, lq)
    for b in (0, 4):
        assert (int(whole.n_accepted[b]), int(whole.next_token[b])) == _greedy_reference(
            logits[b], drafts[b], nd[b]
        )
    assert int(whole.n_accepted[0]) == 2
    perm = np.array([3, 0, 5, 1, 4, 2])
    rs_p = jax.tree.map(lambda x: x[perm], rs)
    res_p = verify_jit(keys[perm], logits[perm], drafts[perm], nd[perm], rs_p, True, lq[perm])
    np.testing.assert_array_equal(res_p.n_accepted, np.asarray(whole.n_accepted)[perm])
    np.testing.assert_array_equal(res_p.next_token, np.asarray(whole.next_token)[perm])
    np.testing.assert_array_equal(res_p.accepted_BxK, np.asarray(whole.accepted_BxK)[perm])
    # Row 1 among different neighbours (other contents, other settings).
    logits2, drafts2, nd2, _, lq2 = _row_case(10)
    rs2 = _rs([1.0, 1.0, 0.0, 0.0, 0.3, 2.0], [0, 0, 0, 0, 5, 0], [1.0, 0.8, 1.0, 1.0, 0.5, 0.9])
    for a, b in ((logits2, logits), (drafts2, drafts), (nd2, nd), (lq2, lq)):
        a[1] = b[1]
    res2 = verify_jit(keys, logits2, drafts2, nd2, rs2, True, lq2)
    assert (int(res2.n_accepted[1]), int(res2.next_token[1])) == (
        int(whole.n_accepted[1]),
        int(whole.next_token[1]),
    )


def test_point_mass_marking_equals_none():
    """draft_logprobs=None and draft_logprobs marked -inf everywhere (mark_point_mass) are the same rule."""
    logits, drafts, nd, rs, lq = _row_case(11)
    marked = mark_point_mass(jnp.asarray(lq), jnp.ones(drafts.shape, bool))
    for seed in range(3):
        k = jax.random.split(jax.random.key(seed), 6)
        a = verify_jit(k, logits, drafts, nd, rs, True, marked)
        b = verify_jit(k, logits, drafts, nd, rs, True)
        np.testing.assert_array_equal(a.n_accepted, b.n_accepted)
        np.testing.assert_array_equal(a.next_token, b.next_token)


def _sorted_reference(x, t, k, p):
    """top-k then top-p by a full stable sort in float64 numpy: the definition filter_logprobs implements."""
    x = x / (t if t > 0 else 1.0)
    order = np.argsort(-x, kind="stable")
    keep = np.ones(len(x), bool) if k <= 0 else np.arange(len(x)) < k
    ps = np.exp(np.where(keep, x[order], -np.inf) - x.max())
    ps /= ps.sum()
    if p < 1:
        keep &= np.cumsum(ps) - ps < p
    out = np.full(len(x), -np.inf)
    out[order[keep]] = x[order[keep]]
    return out - np.logaddexp.reduce(out[np.isfinite(out)])


@pytest.mark.parametrize("candidates", [8, 64, 1024])
def test_filter_cutoff_equals_a_full_sort(candidates):
    """The partial-sort cutoff (lax.top_k of ``candidates``) and its full-sort fallback (top-k beyond the
    candidates, nuclei wider than them) keep exactly the tokens a full sort keeps."""
    rng = np.random.default_rng(candidates)
    f = jax.jit(lambda x, rs: filter_logprobs(x, rs, True, candidates=candidates))
    for V, scale in [(50, 1.0), (300, 0.2), (300, 4.0), (2000, 1.0)]:
        x = (rng.normal(size=(12, V)) * scale).astype(np.float32)
        t = rng.choice([0.0, 0.7, 1.3], 12).astype(np.float32)
        k = rng.choice([0, 1, 5, 40, 700], 12).astype(np.int32)
        p = rng.choice([1.0, 0.9, 0.5, 0.99], 12).astype(np.float32)
        got = np.asarray(f(jnp.asarray(x), RowSampling(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p))))
        for b in range(12):
            ref = _sorted_reference(x[b].astype(np.float64), float(t[b]), int(k[b]), float(p[b]))
            np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(ref))
            np.testing.assert_allclose(got[b][np.isfinite(ref)], ref[np.isfinite(ref)], atol=1e-5)


def test_filter_keeps_every_token_tied_with_the_cutoff():
    x = jnp.asarray([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    lp = filter_logprobs(x, _rs([1.0], [2]), True, candidates=4)  # top-2: 3.0 and all three 2.0s
    assert np.isfinite(np.asarray(lp[0])).tolist() == [True, False, True, True, True, False]
