"""SSD fan-out: how many cache branches each verification outcome gets, and which backup to use.

Pure numpy, float64, host side; nothing here is traced or compiled by JAX. The SSD engine
(``ssd.py``) asks :class:`FanoutEstimator` for a schedule before each cache build, lays the
branches out with :func:`branch_layout` (a static ``(B, budget)`` shape) and feeds the round's
outcomes back with :meth:`FanoutEstimator.observe`. docs/reference.md §4 gives the background.

Geometric fan-out (Theorem 12 of Kumar, Dao & May, "Speculative Speculative Decoding")
-------------------------------------------------------------------------------------
A verification outcome is ``(k, t*)``: ``k ∈ {0..K}`` accepted draft tokens and the bonus
token ``t*``. While the target verifies, the draft pre-drafts ``F_k`` candidate bonus tokens
for each ``k`` under a fixed total ``Σ_k F_k = B`` (the branch budget, fixed so nothing
recompiles). Two modelling assumptions:

* the accepted length is capped-geometric with per-token acceptance ``a``::

      P(k) = (1 − a)·a^k   for k < K,        P(K) = a^K;

* given bucket ``k``, the bonus token misses the draft's top-``F`` candidates with
  probability ``miss(F) = c·F^(−r)`` (``r ≈ 0.3–0.5`` measured); ``F = 0`` always misses.

The hit probability is ``Σ_k P(k)·(1 − c·F_k^(−r))``. Maximising it subject to ``Σ F_k = B``
(Lagrange: ``r·c·P(k)·F_k^(−r−1) = λ`` for every ``k``; the objective is concave in ``F``, so
this stationary point is the maximum) gives::

      F_k ∝ P(k)^(1/(1+r)),   i.e.   F_k = F_0·a^(k/(1+r))                      (k < K)
                                     F_K = F_0·a^(K/(1+r))·(1 − a)^(−1/(1+r))

At high acceptance the all-accepted bucket ``k = K`` is the LARGEST (``≈ 2.84·F_0`` at
``a = 0.9, r = 0.5, K = 7``); at low acceptance almost everything goes to ``k = 0``. The
real-valued ``F`` (:func:`geometric_fanout_real`) is rounded to integers summing exactly to
``B`` by largest remainders (:func:`round_to_budget`).

After a miss served by the FAST backup (near-zero-latency proposals that are point masses
and are almost never accepted) the next outcome is ``k = 0`` with high probability, so a
separate post-miss schedule uses its own acceptance estimate ``a_post`` (prior 0.05).

Online estimates (:class:`FanoutEstimator`)
-------------------------------------------
* ``a``: maximum likelihood for the capped geometric, with a Beta-like pseudo-count prior. A
  row that accepted ``k`` of ``n`` proposals contributes ``k`` successes and one failure if
  ``k < n``, so ``â = (S + w·a0) / (S + F + w)`` with ``w = prior_weight``. Rows drafted by the
  fast backup feed ``a_post`` instead, with prior ``a0_post = 0.05``.
* ``r``: outcomes whose bucket had ``F ≥ 1`` are aggregated by ``F``; a weighted least-squares
  line ``log miss_F = log c − r·log F`` (weights ``n_F·p_F/(1 − p_F)``, the inverse
  delta-method variance of ``log p̂_F``) gives ``r̂`` with precision ``S_xx = Σ w (x − x̄)²``.
  It needs at least two distinct ``F`` values with enough outcomes each (a uniform schedule
  cannot identify ``r``, so the prior stays). ``r̂`` is shrunk towards ``r0`` as a Gaussian
  posterior mean whose prior precision is ``prior_weight``:
  ``r = (S_xx·r̂ + w·r0) / (S_xx + w)``, clipped to ``[0.05, 2]``.

Backup choice (Theorem 7 / Corollary 16)
----------------------------------------
With times normalised by one target verify pass, ``T_p`` the primary speculator's cache-build
time and ``T_b`` the backup's drafting time, SSD's speedup over autoregressive decoding is::

      S = [p_hit·E_hit + (1 − p_hit)·E_miss] / [p_hit^b·max(1, T_p) + (1 − p_hit^b)·(1 + T_b)]

for batch ``b`` (the batch waits for the backup unless every row hits, probability
``p_hit^b``). The neural backup has a larger ``E_miss`` but a larger ``T_b``; the fast backup
wins from the critical batch size ``b*`` on. With ``q = p_hit^b`` the ratio of the two
speedups is a Möbius function of ``q``, hence monotone in ``b``: there is one crossing at most.
"""

from __future__ import annotations

import functools

from typing import Any

import numpy as np

from ssd_jax.analysis.speedup import choose_backup, critical_batch_size, predicted_speedup  # noqa: F401 (re-exported)

A_CLIP = (1e-3, 1.0 - 1e-3)  # a range accepted by the schedule (P(k) stays positive)
R_CLIP = (0.01, 5.0)  # r range accepted by the schedule
R_EST_CLIP = (0.05, 2.0)  # r range the online estimate is clipped to
A0_POST = 0.05  # prior per-token acceptance after a fast-backup round
MIN_COUNT_PER_F = 20  # outcomes needed at one F value before it enters the r fit
#: the step a and r are rounded to before a schedule is built from them (a schedule is integers summing to
#: the budget: a step this small moves a branch only where the unrounded values would be at a tie)
SCHEDULE_STEP = 1.0 / 512


# --- rounding and schedules ----------------------------------------------------------------
def round_to_budget(weights: np.ndarray, budget: int) -> np.ndarray:
    """Largest-remainder (Hamilton) rounding of ``budget·w/Σw`` to non-negative ints summing to ``budget``.

    Every entry gets the floor of its quota; the leftover units go to the largest fractional
    parts, ties to the lower index. All-zero weights put the whole budget on index 0.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"weights must be a non-empty 1-D array, got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and >= 0")
    budget = int(budget)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    out = np.zeros(w.size, dtype=np.int64)
    if not np.any(w > 0):
        out[0] = budget
        return out
    w = w / w.max()  # scale first: 1/Σw would overflow for subnormal weights
    quota = w * (budget / w.sum())
    base = np.floor(quota)
    out[:] = base.astype(np.int64)
    left = budget - int(out.sum())
    if left < 0:  # only from float error in the quotas; take back from the smallest fractions
        order = np.argsort(quota - base, kind="stable")
        order = order[out[order] > 0]
        out[order[:-left]] -= 1
    elif left > 0:
        order = np.argsort(-(quota - base), kind="stable")  # stable: ties keep the lower index first
        out[order[: min(left, w.size)]] += 1
        out[0] += max(0, left - w.size)  # unreachable in exact arithmetic; keeps the sum exact
    return out


def capped_geometric_pmf(a: float, K: int) -> np.ndarray:
    """``P(k)`` for ``k = 0..K``: ``(1 − a)·a^k`` below the cap, ``a^K`` at it (sums to 1)."""
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K}")
    k = np.arange(K + 1, dtype=np.float64)
    p = (1.0 - a) * a**k
    p[K] = a**K
    return p


def geometric_fanout_real(a: float, r: float, K: int, budget: float) -> np.ndarray:
    """Real-valued Theorem 12 fan-out ``F_k = budget·P(k)^(1/(1+r)) / Σ_j P(j)^(1/(1+r))``.

    ``a`` is clipped to ``[1e-3, 1 − 1e-3]`` and ``r`` to ``[0.01, 5]``; computed in log space so
    long lookaheads at small ``a`` do not underflow.
    """
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K}")
    a = float(np.clip(a, *A_CLIP))
    r = float(np.clip(r, *R_CLIP))
    k = np.arange(K + 1, dtype=np.float64)
    log_p = np.log1p(-a) + k * np.log(a)
    log_p[K] = K * np.log(a)
    z = log_p / (1.0 + r)
    w = np.exp(z - z.max())
    return float(budget) * w / w.sum()


def geometric_fanout(a: float, r: float, K: int, budget: int) -> np.ndarray:
    """Theorem 12 fan-out rounded to ints: shape ``(K+1,)``, int64, summing exactly to ``budget``."""
    return _geometric_fanout(float(a), float(r), int(K), int(budget)).copy()


@functools.lru_cache(maxsize=1024)
def _geometric_fanout(a: float, r: float, K: int, budget: int) -> np.ndarray:
    return round_to_budget(geometric_fanout_real(a, r, K, 1.0), budget)


def uniform_fanout(F: int, K: int) -> np.ndarray:
    """``F`` branches for every ``k = 0..K`` (budget ``F·(K+1)``)."""
    if F < 0 or K < 0:
        raise ValueError(f"F and K must be >= 0, got F={F}, K={K}")
    return np.full(K + 1, int(F), dtype=np.int64)


def predicted_hit_rate(fanout: np.ndarray, a: float, r: float, c: float = 1.0) -> float:
    """Model hit probability ``Σ_k P(k)·(1 − min(1, c·F_k^(−r)))`` of a (possibly real) schedule.

    ``F_k = 0`` never hits. This is the objective Theorem 12 maximises.
    """
    f = np.asarray(fanout, dtype=np.float64)
    p = capped_geometric_pmf(a, f.size - 1)
    with np.errstate(divide="ignore"):
        miss = np.where(f > 0, np.minimum(1.0, c * np.power(np.maximum(f, 1e-300), -r)), 1.0)
    return float(np.sum(p * (1.0 - miss)))


def branch_layout(fanout_BxKp1: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Enumerate each row's branches: for ``k = 0..K``, ranks ``0..F[b, k] − 1``, in that order.

    Returns ``(k_of_branch_BxN, rank_of_branch_BxN)``, int32 with ``N = budget``; slots past a
    row's total are padding (``k = rank = −1``). Raises ``ValueError`` if a row exceeds ``budget``.
    """
    f = np.asarray(fanout_BxKp1)
    if f.ndim != 2:
        raise ValueError(f"fanout must be (B, K+1), got shape {f.shape}")
    if not np.issubdtype(f.dtype, np.integer):
        if not np.all(np.equal(np.mod(f, 1), 0)):
            raise ValueError("fanout entries must be integers")
    f = f.astype(np.int64)
    if np.any(f < 0):
        raise ValueError("fanout entries must be >= 0")
    budget = int(budget)
    totals = f.sum(axis=1)
    if np.any(totals > budget):
        raise ValueError(f"a row's fan-out sums to {int(totals.max())} > budget {budget}")
    B, Kp1 = f.shape
    ends = np.cumsum(f, axis=1)  # (B, K+1): exclusive end slot of each bucket
    slot = np.arange(budget, dtype=np.int64)
    # bucket of slot j = number of buckets that end at or before j
    k = (ends[:, None, :] <= slot[None, :, None]).sum(axis=2)  # (B, N)
    valid = k < Kp1
    kc = np.minimum(k, Kp1 - 1)
    starts = np.take_along_axis(ends - f, kc, axis=1)
    rank = slot[None, :] - starts
    k_out = np.where(valid, k, -1).astype(np.int32)
    rank_out = np.where(valid, rank, -1).astype(np.int32)
    return k_out.reshape(B, budget), rank_out.reshape(B, budget)


# --- online estimation ---------------------------------------------------------------------
class FanoutEstimator:
    """Online estimates of the per-token acceptance a and the miss exponent r, and the schedules they imply."""

    def __init__(
        self,
        K: int,
        budget: int,
        mode: str = "geometric",
        uniform_F: int | None = None,
        a0: float = 0.7,
        r0: float = 0.4,
        prior_weight: float = 8.0,
    ) -> None:
        if K < 0 or budget < 0:
            raise ValueError(f"K and budget must be >= 0, got K={K}, budget={budget}")
        if mode not in ("geometric", "uniform"):
            raise ValueError(f"mode must be 'geometric' or 'uniform', got {mode!r}")
        if mode == "uniform":
            if uniform_F is None or uniform_F * (K + 1) != budget:
                raise ValueError(
                    f"uniform mode needs budget == uniform_F*(K+1); got uniform_F={uniform_F}, "
                    f"K={K}, budget={budget}"
                )
        if not 0.0 < a0 < 1.0:
            raise ValueError(f"a0 must be in (0, 1), got {a0}")
        if r0 <= 0 or prior_weight <= 0:
            raise ValueError(f"r0 and prior_weight must be > 0, got r0={r0}, prior_weight={prior_weight}")
        self.K, self.budget, self.mode, self.uniform_F = int(K), int(budget), mode, uniform_F
        self.a0, self.r0, self.prior_weight = float(a0), float(r0), float(prior_weight)
        # capped-geometric sufficient statistics: [normal rows, post-miss rows]
        self._succ = np.zeros(2)
        self._fail = np.zeros(2)
        self._rows = np.zeros(2, dtype=np.int64)
        # outcomes and misses by the fan-out F of the outcome's bucket (index = F)
        self._n_by_F = np.zeros(self.budget + 1, dtype=np.int64)
        self._miss_by_F = np.zeros(self.budget + 1, dtype=np.int64)
        self._fit: tuple[float, float] | None = None  # cached (r, c)

    # estimates
    def _a_of(self, i: int, prior: float) -> float:
        w = self.prior_weight
        return float((self._succ[i] + w * prior) / (self._succ[i] + self._fail[i] + w))

    @property
    def a(self) -> float:
        """Per-token acceptance of cache / neural-drafter speculations."""
        return self._a_of(0, self.a0)

    @property
    def a_post(self) -> float:
        """Per-token acceptance of fast-backup speculations (prior 0.05)."""
        return self._a_of(1, A0_POST)

    def _fit_r(self) -> tuple[float, float]:
        if self._fit is not None:
            return self._fit
        n = self._n_by_F.astype(np.float64)
        F = np.arange(n.size, dtype=np.float64)
        use = (F >= 1) & (n >= MIN_COUNT_PER_F)
        r, c = self.r0, float("nan")
        if use.sum() >= 2:
            n, m, F = n[use], self._miss_by_F[use].astype(np.float64), F[use]
            p = (m + 0.5) / (n + 1.0)  # smoothed miss rate, never 0 or 1
            x, y = np.log(F), np.log(p)
            w = n * p / (1.0 - p)  # 1 / Var(log p̂) by the delta method
            xm, ym = np.sum(w * x) / w.sum(), np.sum(w * y) / w.sum()
            sxx = float(np.sum(w * (x - xm) ** 2))
            r_hat = -float(np.sum(w * (x - xm) * (y - ym))) / sxx
            r = (sxx * r_hat + self.prior_weight * self.r0) / (sxx + self.prior_weight)
            r = float(np.clip(r, *R_EST_CLIP))
            c = float(np.clip(np.exp(ym + r * xm), 1e-6, 1.0))
        self._fit = (r, c)
        return self._fit

    @property
    def r(self) -> float:
        """Miss-rate exponent in ``miss(F) = c·F^(−r)`` (``r0`` until two F values have data)."""
        return self._fit_r()[0]

    @property
    def c(self) -> float:
        """Miss rate at ``F = 1`` of the fitted power law (NaN until the fit exists)."""
        return self._fit_r()[1]

    # schedules
    def schedule_params(self, post_miss: bool = False) -> tuple[float, float]:
        """(a, r) the schedules are built from, rounded to :data:`SCHEDULE_STEP`: a round's tables are
        rebuilt (and uploaded) only when these move, not after every round's small update."""
        a = self.a_post if post_miss else self.a
        return round(a / SCHEDULE_STEP) * SCHEDULE_STEP, round(self.r / SCHEDULE_STEP) * SCHEDULE_STEP

    def key(self) -> tuple:
        """What every schedule of this estimator is a function of (equal keys, equal schedules)."""
        if self.mode == "uniform":
            return ("uniform",)
        return (*self.schedule_params(False), *self.schedule_params(True))

    def schedule(self, post_miss: bool = False) -> np.ndarray:
        """Fan-out ``(K+1,)`` int64 summing to ``budget``; ``post_miss`` after a fast-backup round."""
        if self.mode == "uniform":
            return uniform_fanout(int(self.uniform_F or 0), self.K)
        return geometric_fanout(*self.schedule_params(post_miss), self.K, self.budget)

    def observe(
        self,
        k: np.ndarray,
        n_draft: np.ndarray,
        hit: np.ndarray,
        fanout_used: np.ndarray,
        post_miss: np.ndarray,
    ) -> None:
        """Record one finished round, one entry per live row.

        ``k`` accepted tokens (``0..n_draft``), ``n_draft`` proposals, ``hit`` whether ``(k, bonus)``
        was cached, ``fanout_used`` ``(n, K+1)`` the schedule each row's cache was built with,
        ``post_miss`` whether the row's speculation came from the fast backup. Outcomes whose
        bucket had ``F = 0`` cannot hit and carry no information on ``r``; they are skipped there.
        """
        k = np.asarray(k, dtype=np.int64).reshape(-1)
        n = k.size
        n_draft = np.broadcast_to(np.asarray(n_draft, dtype=np.int64).reshape(-1), (n,))
        hit = np.broadcast_to(np.asarray(hit, dtype=bool).reshape(-1), (n,))
        post = np.broadcast_to(np.asarray(post_miss, dtype=bool).reshape(-1), (n,))
        if n == 0:
            return
        fan = np.asarray(fanout_used, dtype=np.int64).reshape(n, -1)
        if fan.shape[1] != self.K + 1:
            raise ValueError(f"fanout_used must be (n, {self.K + 1}), got {fan.shape}")
        if np.any(k < 0) or np.any(k > n_draft) or np.any(n_draft > self.K):
            raise ValueError("need 0 <= k <= n_draft <= K for every row")
        for i, rows in enumerate((~post, post)):
            self._succ[i] += k[rows].sum()
            self._fail[i] += np.sum(k[rows] < n_draft[rows])
            self._rows[i] += rows.sum()
        F = fan[np.arange(n), k]
        seen = F >= 1
        if seen.any():
            top = int(F.max())
            if top >= self._n_by_F.size:  # a schedule above our budget: grow the tables
                grow = top + 1 - self._n_by_F.size
                self._n_by_F = np.concatenate([self._n_by_F, np.zeros(grow, np.int64)])
                self._miss_by_F = np.concatenate([self._miss_by_F, np.zeros(grow, np.int64)])
            size = self._n_by_F.size
            self._n_by_F += np.bincount(F[seen], minlength=size)
            self._miss_by_F += np.bincount(F[seen & ~hit], minlength=size)
            self._fit = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready snapshot of the estimates and the schedules they imply."""
        used = np.nonzero(self._n_by_F)[0]
        c = self.c
        return {
            "mode": self.mode,
            "K": self.K,
            "budget": self.budget,
            "a": self.a,
            "a_post": self.a_post,
            "r": self.r,
            "c": None if np.isnan(c) else c,
            "rows_observed": int(self._rows[0]),
            "rows_observed_post_miss": int(self._rows[1]),
            "miss_by_F": {str(int(f)): [int(self._n_by_F[f]), int(self._miss_by_F[f])] for f in used},
            "schedule": self.schedule().tolist(),
            "schedule_post_miss": self.schedule(post_miss=True).tolist(),
        }
