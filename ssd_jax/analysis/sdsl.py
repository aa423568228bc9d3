"""SDSL: how big should the draft model be? (Speculative Decoding Scaling Laws)

Implements the throughput model of Bozorgkhoo & Molybog, "Speculative Decoding Scaling Laws
(SDSL): Throughput Optimization Made Simple" (arXiv 2603.11053), docs/reference.md §7. Pure numpy,
float64, over parameter counts; nothing here is traced or compiled by JAX, and nothing here
loads a model (the CLI, ``python -m ssd_jax.sdsl`` in :mod:`ssd_jax.cli.sdsl`, counts a real
target's parameters from its config).

The model
---------
* Cost (batch 1, memory bound): one speculation round runs ``γ`` passes of an
  ``N``-parameter draft and ONE pass of the ``M``-parameter target, costing ``2(M + γN)``.
  With a per-token acceptance rate ``α`` a round yields ``E[τ] = (1 − α^(γ+1)) / (1 − α)``
  tokens, so::

      throughput T(α, γ, N, M) = E[τ] / (2(M + γN))
      speedup over autoregressive decoding = E[τ]·M / (M + γN) = 2M·T

* Optimal lookahead. ``d log T / dγ = 0`` gives ``(1 − u)·e^u = α^(r−1)`` with
  ``u = (γ + r)·ln α`` and ``r = M/N``; with ``w = u − 1`` this is ``w·e^w = −α^(r−1)/e``, and
  the root with ``u < 0`` is the ``W₋₁`` branch of Lambert W::

      γ*(α, r) = (1 + W₋₁(−α^(r−1)/e)) / ln α − r

  For realistic ``r`` (hundreds) ``α^(r−1)`` underflows, so the equation is solved in log
  space, ``w + ln(−w) = (r − 1)·ln α − 1`` with ``w < −1`` (:func:`lambertw_m1_log`, our own
  Newton solver). ``T`` has a single stationary point in ``γ`` (a maximum); when it lies
  below 0 (or does not exist, ``r ≤ 1``) the best lookahead is ``γ = 0``, i.e. no speculation.
  The paper's ``γ`` is continuous; the best integer lookahead is the floor or ceiling of
  ``γ*`` (:func:`best_integer_gamma`).

* Acceptance from perplexities (linear fit on HellaSwag over OPT, LLaMA-3, Qwen1.5/2.5 and
  Seed-OSS pairs, R² ≈ 0.60)::

      α = A·x + B·y + C,  x = draft perplexity, y = target perplexity,
      A = −0.0067, B = +0.01297, C = 0.642

  A linear law can leave (0, 1) (very weak drafts give ``α ≤ 0``); :func:`alpha_from_ppl`
  clips it into ``[ALPHA_EPS, 1 − ALPHA_EPS]`` so the throughput model stays defined (a
  clipped-to-zero draft simply never pays off: ``γ* = 0``).

* Perplexity from size: Chinchilla's parametric loss ``L(N, D) = E + A_L/N^a + B_L/D^b``
  (``E = 1.69, A_L = 406.4, B_L = 410.7, a = 0.34, b = 0.28``), per-token perplexity
  ``exp(L)``. Draft and target are both assumed trained on ``D`` tokens.

* Draft sizing: maximise ``T`` over ``N`` with ``γ = γ*(α(N), M/N)`` re-optimised at every
  ``N`` (:func:`optimal_draft`, :func:`n_opt`): a log-spaced grid, then golden-section
  refinement in ``log N``. Over 13–110B targets the optimum is close to linear,
  ``N_opt ≈ μ·M + M₀`` with the paper's ``μ = 2.71e-3, M₀ = 8.71e7`` (70B → ≈0.28B, the
  "≈200× smaller" rule). That line is a fit over 13–110B only; for smaller (or larger)
  targets use the full optimisation, which is what this module always reports.

Conventions chosen to reproduce the paper (``python -m ssd_jax.sdsl --fit`` prints the fit)
------------------------------------------------------------------------------------
* ``D`` (training tokens, the same for draft and target) is not stated with the fit. It
  moves the optimum weakly: each 10× more tokens lowers μ and M₀ by ≈ 6–12% and N_opt(70B)
  by ≈ 6–11% (1e11: 0.31B, 1e12: 0.28B, 1e13: 0.26B, D = ∞: 0.24B). The default
  ``D = 5e11`` gives μ = 2.66e-3 (−1.8%), M₀ = 9.14e7 (+4.9%) over 25 evenly spaced targets,
  N_opt(70B) = 0.284B (+1%), and the paper's flatness (1B draft −4.5%, 8B −33.8% for 70B).
  No single ``D`` hits μ and M₀ exactly with evenly spaced targets (D ≈ 3.5e11 matches μ,
  D ≈ 2e12 matches M₀); how the fitted targets are spaced moves μ and M₀ by a few %
  (N_opt(M) is slightly concave, R² of the line ≈ 0.991).
* ``γ`` is continuous (as in the paper's closed form); ``integer_gamma=True`` uses the best
  integer lookahead instead (N_opt(70B) +1%; fit μ −3%, M₀ +7% vs the paper: the
  continuous γ reproduces the paper slightly better).
* Parameter counts are TOTAL parameters including embeddings, with tied input/output
  embeddings counted once: the convention of the nominal model sizes the paper fits and
  validates on (OPT-125M, 13B, 70B …). Over 13–110B embeddings are ≲ 4% of the parameters,
  so the fit itself cannot tell the conventions apart; for small models (e.g. SmolLM2-135M,
  where embeddings are ~20%) the choice matters and is reported next to the result.
* Caveat (the paper's own): this is a batch-1, weight-read cost model. At large batch the
  verification becomes compute bound and the best draft gets smaller.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from ssd_jax.errors import UserError

__all__ = [
    "ACCEPTANCE",
    "CHINCHILLA",
    "DEFAULT_TOKENS",
    "FIT_RANGE",
    "PAPER_M0",
    "PAPER_MU",
    "AcceptanceLaw",
    "DraftPlan",
    "LinearFit",
    "LossLaw",
    "alpha_from_ppl",
    "best_integer_gamma",
    "evaluate_draft",
    "expected_tokens",
    "fit_linear",
    "flatness",
    "gamma_star",
    "lambertw_m1",
    "lambertw_m1_log",
    "loss",
    "n_opt",
    "optimal_draft",
    "parse_size",
    "perplexity",
    "refit_acceptance",
    "speedup",
    "throughput",
]


class LossLaw(NamedTuple):
    """Chinchilla parametric loss L(N, D) = E + A_L/N^a + B_L/D^b (nats per token)."""

    E: float = 1.69
    A_L: float = 406.4
    B_L: float = 410.7
    a: float = 0.34
    b: float = 0.28


class AcceptanceLaw(NamedTuple):
    """α = A·(draft perplexity) + B·(target perplexity) + C."""

    A: float = -0.0067
    B: float = 0.01297
    C: float = 0.642


CHINCHILLA = LossLaw()
ACCEPTANCE = AcceptanceLaw()
#: Training tokens assumed for draft and target. Calibrated: with continuous γ it gives
#: μ = 2.66e-3 (paper 2.71e-3), M₀ = 9.14e7 (paper 8.71e7), N_opt(70B) = 2.84e8 (paper ≈2.8e8).
DEFAULT_TOKENS = 5e11
FIT_RANGE = (13e9, 110e9)
PAPER_MU = 2.71e-3
PAPER_M0 = 8.71e7
#: α is kept inside [ALPHA_EPS, 1 - ALPHA_EPS] by :func:`alpha_from_ppl`.
ALPHA_EPS = 1e-6

_NEWTON_ITERS = 60
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


# --- cost model -------------------------------------------------------------------------
def _check_alpha(alpha: np.ndarray) -> None:
    if np.any(~((alpha > 0) & (alpha < 1))):
        raise ValueError("acceptance rate alpha must lie strictly between 0 and 1")


def expected_tokens(alpha, gamma):
    """E[τ] = (1 − α^(γ+1)) / (1 − α): tokens produced per round (accepted + the bonus one).

    ``alpha`` in [0, 1] (α = 1 gives γ + 1, α = 0 gives 1); broadcasts, and returns a numpy
    scalar (a ``float``) for scalar inputs. The one definition: the performance model
    (:mod:`ssd_jax.analysis.perfmodel`) uses it too, with γ = K.
    """
    alpha = np.asarray(alpha, np.float64)
    gamma = np.asarray(gamma, np.float64)
    if np.any(~((alpha >= 0) & (alpha <= 1))):
        raise ValueError(f"acceptance rate alpha must lie in [0, 1], got {alpha}")
    one = alpha == 1.0
    a = np.where(one, 0.5, alpha)  # any value in (0, 1): the α = 1 entries are replaced below
    with np.errstate(divide="ignore"):  # log(0) = -inf gives E[τ] = 1, as it should
        et = -np.expm1((gamma + 1.0) * np.log(a)) / (1.0 - a)
    return np.where(one, gamma + 1.0, et)[()]


def throughput(alpha, gamma, N, M) -> np.ndarray:
    """Tokens per unit cost: (1 − α^(γ+1)) / ((1 − α)·2(M + γN)). Broadcasts."""
    N = np.asarray(N, np.float64)
    M = np.asarray(M, np.float64)
    gamma = np.asarray(gamma, np.float64)
    return expected_tokens(alpha, gamma) / (2.0 * (M + gamma * N))


def speedup(alpha, gamma, N, M) -> np.ndarray:
    """Speedup over autoregressive decoding: E[τ]·M / (M + γN) (= 2M·throughput)."""
    N = np.asarray(N, np.float64)
    M = np.asarray(M, np.float64)
    gamma = np.asarray(gamma, np.float64)
    return expected_tokens(alpha, gamma) * M / (M + gamma * N)


# --- Lambert W, lower branch ------------------------------------------------------------
def lambertw_m1_log(log_neg_z) -> np.ndarray:
    """W₋₁(z) for z = −exp(log_neg_z) ∈ [−1/e, 0), given ``log_neg_z = ln(−z) ≤ −1``.

    Solves ``w + ln(−w) = ln(−z)`` for ``w ≤ −1`` without ever forming ``z`` (so
    ``z = −1e−5000`` is fine). Writing ``w = −1 − d`` (``d ≥ 0``) the equation is
    ``g(d) = log1p(d) − d − s = 0`` with ``s = ln(−z) + 1 ≤ 0``; Newton on ``g`` starts from
    the branch-point series ``d ≈ p + p²/3 + 11p³/72`` (``p = √(−2s)``) near ``z = −1/e`` and
    from the asymptotic ``w ≈ L − ln(−L) + ln(−L)/L`` elsewhere, and converges in a few
    steps. Returns NaN where ``ln(−z) > −1`` (no real solution).
    """
    L = np.asarray(log_neg_z, np.float64)
    s = L + 1.0
    bad = ~(s <= 0.0)  # also catches NaN
    s = np.where(bad, -1.0, s)
    Lc = s - 1.0
    p = np.sqrt(-2.0 * s)
    q = np.minimum(p, 1.0)  # the series is only used for p < 1
    d_near = q + q * q / 3.0 + (11.0 / 72.0) * q**3
    lnl = np.log(-Lc)
    d_far = -1.0 - (Lc - lnl + lnl / Lc)
    d = np.where(p < 1.0, d_near, np.maximum(d_far, p))
    for _ in range(_NEWTON_ITERS):
        g = np.log1p(d) - d - s
        gp = -d / (1.0 + d)
        step = np.where(d > 0.0, g / np.where(d > 0.0, gp, 1.0), 0.0)
        d_new = np.maximum(d - step, 0.5 * d)  # never jump to d <= 0
        done = np.all(np.abs(d_new - d) <= 1e-15 * (1.0 + d))
        d = d_new
        if done:
            break
    w = -1.0 - d
    return np.where(bad, np.nan, w)


def lambertw_m1(z) -> np.ndarray:
    """W₋₁(z) for real z ∈ [−1/e, 0): the solution w ≤ −1 of w·e^w = z (NaN outside)."""
    z = np.asarray(z, np.float64)
    ok = (z < 0.0) & (z >= -math.exp(-1.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.where(ok, np.log(np.where(ok, -z, 1.0)), np.nan)
    # rounding can put z = -1/e a hair outside the branch: snap it to the branch point
    L = np.where(ok, np.minimum(L, -1.0), np.nan)
    return lambertw_m1_log(L)


# --- optimal lookahead ------------------------------------------------------------------
def gamma_star(alpha, r, clip: bool = True) -> np.ndarray:
    """Throughput-optimal (continuous) lookahead for acceptance ``alpha`` and size ratio r = M/N.

    ``γ* = (1 + W₋₁(−α^(r−1)/e)) / ln α − r``, computed in log space. With ``clip`` (the
    default) the result is the best ``γ ≥ 0``: 0 where the stationary point is negative or
    does not exist (``r ≤ 1``: a draft at least as large as the target never pays). Without
    ``clip`` the stationary point itself is returned (NaN where none exists).
    """
    alpha = np.asarray(alpha, np.float64)
    r = np.asarray(r, np.float64)
    _check_alpha(alpha)
    if np.any(~(r > 0)):
        raise ValueError("size ratio r = M/N must be positive")
    ln_a = np.log(alpha)
    L = (r - 1.0) * ln_a - 1.0
    w = lambertw_m1_log(np.where(L <= -1.0, L, np.nan))
    g = (1.0 + w) / ln_a - r
    if clip:
        g = np.where(np.isnan(g) | (g < 0.0), 0.0, g)
    return g


def best_integer_gamma(alpha, r) -> np.ndarray:
    """The best integer lookahead ≥ 0: floor or ceil of γ* (T is unimodal in γ)."""
    alpha = np.asarray(alpha, np.float64)
    r = np.asarray(r, np.float64)
    g = gamma_star(alpha, r)
    lo = np.floor(g)
    hi = lo + 1.0
    # compare throughput with N = 1, M = r (only the ratio matters)
    better_hi = throughput(alpha, hi, 1.0, r) > throughput(alpha, lo, 1.0, r)
    return np.where(better_hi, hi, lo)


# --- acceptance and loss laws -----------------------------------------------------------
def alpha_from_ppl(
    x_draft_ppl,
    y_target_ppl,
    A: float = ACCEPTANCE.A,
    B: float = ACCEPTANCE.B,
    C: float = ACCEPTANCE.C,
    clip: bool = True,
) -> np.ndarray:
    """α = A·x + B·y + C from the draft's (x) and target's (y) per-token perplexities.

    The linear law is unbounded; with ``clip`` the result is kept in
    ``[ALPHA_EPS, 1 − ALPHA_EPS]`` (a draft so weak that the law says α ≤ 0 is treated as
    accepting essentially nothing).
    """
    a = A * np.asarray(x_draft_ppl, np.float64) + B * np.asarray(y_target_ppl, np.float64) + C
    return np.clip(a, ALPHA_EPS, 1.0 - ALPHA_EPS) if clip else a


def loss(
    N,
    D=DEFAULT_TOKENS,
    E: float = CHINCHILLA.E,
    A_L: float = CHINCHILLA.A_L,
    B_L: float = CHINCHILLA.B_L,
    a: float = CHINCHILLA.a,
    b: float = CHINCHILLA.b,
) -> np.ndarray:
    """Chinchilla loss L(N, D) = E + A_L/N^a + B_L/D^b (nats/token); D = inf drops the data term."""
    N = np.asarray(N, np.float64)
    D = np.asarray(D, np.float64)
    return E + A_L * N ** (-a) + B_L * D ** (-b)


def perplexity(N, D=DEFAULT_TOKENS, law: LossLaw = CHINCHILLA) -> np.ndarray:
    """Per-token perplexity exp(L(N, D))."""
    return np.exp(loss(N, D, *law))


# --- draft sizing -----------------------------------------------------------------------
@dataclasses.dataclass
class DraftPlan:
    """The model's prediction for an N-parameter draft speculating for an M-parameter target.

    ``throughput`` is in tokens per 2·(parameter reads); ``speedup`` is over autoregressive
    decoding of the target (= 2M·throughput). Fields are floats (or arrays from
    :func:`evaluate_draft` with an array of N).
    """

    M: Any
    N: Any
    D: float
    alpha: Any
    gamma: Any
    draft_ppl: Any
    target_ppl: Any
    expected_tokens: Any
    throughput: Any
    speedup: Any
    integer_gamma: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in dataclasses.asdict(self).items()
        }


def _positive(name: str, v) -> np.ndarray:
    a = np.asarray(v, np.float64)
    if a.size == 0 or np.any(~np.isfinite(a)) or np.any(a <= 0):
        raise UserError(f"{name} must be positive and finite, got {v!r}")
    return a


def _check_tokens(D) -> float:
    D = float(D)
    if not D > 0:  # inf is allowed (no data term)
        raise UserError(f"training tokens D must be positive, got {D!r}")
    return D


def evaluate_draft(
    M,
    N,
    D=DEFAULT_TOKENS,
    *,
    integer_gamma: bool = False,
    law: LossLaw = CHINCHILLA,
    acceptance: AcceptanceLaw = ACCEPTANCE,
) -> DraftPlan:
    """Predicted α, best γ, throughput and speedup for draft size(s) N and target size M."""
    M = float(_positive("target parameters M", M))
    N = _positive("draft parameters N", N)
    D = _check_tokens(D)
    x = perplexity(N, D, law)
    y = perplexity(M, D, law)
    alpha = alpha_from_ppl(x, y, *acceptance)
    r = M / N
    gamma = best_integer_gamma(alpha, r) if integer_gamma else gamma_star(alpha, r)
    et = expected_tokens(alpha, gamma)
    t = throughput(alpha, gamma, N, M)
    s = speedup(alpha, gamma, N, M)
    out = dict(alpha=alpha, gamma=gamma, draft_ppl=x, expected_tokens=et, throughput=t, speedup=s)
    if N.ndim == 0:
        out = {k: float(v) for k, v in out.items()}
        N = float(N)
    return DraftPlan(M=M, N=N, D=D, target_ppl=float(y), integer_gamma=integer_gamma, **out)


def optimal_draft(
    M,
    D=DEFAULT_TOKENS,
    *,
    integer_gamma: bool = False,
    law: LossLaw = CHINCHILLA,
    acceptance: AcceptanceLaw = ACCEPTANCE,
    grid_points: int = 241,
) -> DraftPlan:
    """The throughput-optimal draft size for target size M (γ re-optimised at every N).

    Searches N over ``[M·1e−6, M]`` on a log-spaced grid, then refines around the best grid
    point: golden-section search in log N for continuous γ; for integer γ (whose envelope
    over γ = 0, 1, 2, … has kinks) two rounds of a finer local grid.
    """
    M = float(_positive("target parameters M", M))
    D = _check_tokens(D)
    kw = dict(integer_gamma=integer_gamma, law=law, acceptance=acceptance)

    def f(logn):
        return evaluate_draft(M, np.exp(logn), D, **kw).throughput

    lo, hi = math.log(max(M * 1e-6, 1.0)), math.log(M)
    grid = np.linspace(lo, hi, grid_points)
    t = f(grid)
    i = int(np.argmax(t))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, grid_points - 1)]
    if integer_gamma:
        for _ in range(2):
            g = np.linspace(a, b, 201)
            j = int(np.argmax(f(g)))
            a, b = g[max(j - 1, 0)], g[min(j + 1, 200)]
        best = 0.5 * (a + b)
    else:  # golden-section search for the maximum on [a, b]
        c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
        fc, fd = f(c), f(d)
        while b - a > 1e-9:
            if fc >= fd:
                b, d, fd = d, c, fc
                c = b - _GOLDEN * (b - a)
                fc = f(c)
            else:
                a, c, fc = c, d, fd
                d = a + _GOLDEN * (b - a)
                fd = f(d)
        best = 0.5 * (a + b)
    if f(best) < t[i]:  # refinement cannot lose to the grid, but be safe at the edges
        best = grid[i]
    return evaluate_draft(M, math.exp(best), D, **kw)


def n_opt(M, D=DEFAULT_TOKENS, **kw) -> float:
    """Throughput-optimal draft size (parameters) for target size M; see :func:`optimal_draft`."""
    return float(optimal_draft(M, D, **kw).N)


@dataclasses.dataclass
class LinearFit:
    """Least-squares line N_opt = mu·M + M0 over the targets Ms (r2: coefficient of determination)."""

    mu: float
    M0: float
    r2: float
    Ms: list[float]
    Ns: list[float]


def fit_linear(Ms=None, D=DEFAULT_TOKENS, **kw) -> LinearFit:
    """Fit N_opt = μ·M + M₀ by least squares; Ms defaults to 25 targets evenly over 13–110B."""
    Ms = np.linspace(*FIT_RANGE, 25) if Ms is None else _positive("target sizes", Ms).ravel()
    if Ms.size < 2:
        raise UserError("fit_linear needs at least two target sizes")
    Ns = np.array([n_opt(m, D, **kw) for m in Ms])
    X = np.stack([Ms, np.ones_like(Ms)], axis=1)
    (mu, m0), *_ = np.linalg.lstsq(X, Ns, rcond=None)
    resid = Ns - X @ np.array([mu, m0])
    ss = float(np.sum((Ns - Ns.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / ss if ss > 0 else 1.0
    return LinearFit(float(mu), float(m0), r2, Ms.tolist(), Ns.tolist())


def flatness(M, D=DEFAULT_TOKENS, factors=(0.25, 0.5, 2.0, 4.0), drafts=(), **kw) -> list[dict[str, float]]:
    """How flat the optimum is: drafts at N_opt·factor (and any explicit ``drafts`` sizes).

    Each row: factor (N/N_opt), N, gamma, alpha, speedup, rel_throughput (T/T_opt, equal to
    the speedup ratio) and loss_pct = 100·(1 − rel_throughput). γ is re-optimised at each N.
    """
    best = optimal_draft(M, D, **kw)
    extra = _positive("draft sizes", drafts).ravel().tolist() if len(drafts) else []
    Ns = [best.N * float(f) for f in factors] + extra
    rows = []
    for n in Ns:
        p = evaluate_draft(
            best.M,
            n,
            D,
            integer_gamma=kw.get("integer_gamma", False),
            law=kw.get("law", CHINCHILLA),
            acceptance=kw.get("acceptance", ACCEPTANCE),
        )
        rel = p.throughput / best.throughput
        rows.append(
            dict(
                factor=n / best.N,
                N=n,
                gamma=p.gamma,
                alpha=p.alpha,
                speedup=p.speedup,
                rel_throughput=rel,
                loss_pct=100.0 * (1.0 - rel),
            )
        )
    return rows


def refit_acceptance(x_ppls, y_ppls, alphas) -> tuple[float, float, float, float]:
    """Least-squares fit of α = A·x + B·y + C; returns (A, B, C, R²)."""
    x = np.asarray(x_ppls, np.float64).ravel()
    y = np.asarray(y_ppls, np.float64).ravel()
    al = np.asarray(alphas, np.float64).ravel()
    if not (x.size == y.size == al.size) or x.size < 3:
        raise ValueError("need at least three (draft ppl, target ppl, alpha) triples of equal length")
    X = np.stack([x, y, np.ones_like(x)], axis=1)
    coef, *_ = np.linalg.lstsq(X, al, rcond=None)
    resid = al - X @ coef
    ss = float(np.sum((al - al.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / ss if ss > 0 else 1.0
    return float(coef[0]), float(coef[1]), float(coef[2]), r2


# --- sizes as text ------------------------------------------------------------------------
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_size(s: str) -> float:
    """A positive, finite parameter or token count from text: ``70e9``, ``70B``, ``10M``, ``5e11``."""
    t = s.strip().upper()
    mult = 1.0
    if t and t[-1] in _SUFFIX:
        t, mult = t[:-1], _SUFFIX[t[-1]]
    try:
        v = float(t) * mult
    except ValueError:
        raise UserError(f"not a number: {s!r} (e.g. 70e9 or 70B)") from None
    if not (math.isfinite(v) and v > 0):
        raise UserError(f"sizes must be positive and finite, got {s!r}")
    return v
