"""SSD's own round: the K and the fan-out budget M that its cost model expects to be fastest.

SD's round model (:mod:`ssd_jax.planning.sd_model`) prices a round as ``K`` draft steps plus one verify.
An SSD round is different (docs/reference.md §4 and §6): while the target verifies ``K + 1``
tokens, the draft re-runs the round's tokens and builds ``M`` branches per row for ``K`` steps;
on a cache hit the next round's speculation is ready at once, on a miss the neural backup
drafts ``K`` tokens first. Pure numpy, host side, from one :class:`~ssd_jax.planning.records.Calibration`:

* hits are simulated, not assumed: on the target's greedy continuation, a round starting at
  ``t`` accepts the draft's leading matches ``a`` (teacher-forced argmax, as SD's α is
  measured), and the outcome ``(a, bonus)`` hits when the bonus's rank among the draft's own
  logits at that position is inside the branch count the geometric schedule
  (:func:`.fanout.geometric_fanout`, Theorem 12) gives bucket ``a``: rank ``≤ F_a`` below the
  cap (the rejected proposal, the draft's argmax, is never a branch), rank ``< F_K`` at it;
* the build costs ``t_d(B·(K+1))`` (the re-run) plus ``K·t_d(B·M)`` (one draft step at ``B·M``
  rows per depth), from draft steps timed at a few row counts and interpolated;
* with the draft on devices of its own (two meshes) a round costs ``max(verify, build)`` on a
  hit; on one device the two run one after the other: ``verify + build``. A miss adds
  ``K·t_d(B)``.

Expected speedup over AR: ``S = E[tokens a round]·t_ar / (p_hit·T_hit + (1 − p_hit)·T_miss)``.
"""

from __future__ import annotations

import numpy as np

from ssd_jax.decoding.spec import K_MAX
from ssd_jax.decoding.ssd.fanout import geometric_fanout
from ssd_jax.planning.sd_model import interpolate_verify

#: the miss exponent r the schedule assumes before a run has measured its own (FanoutEstimator's prior)
R_PRIOR = 0.4
#: fan-out budgets tried, in branches per acceptance position (M = m·(K + 1))
M_PER_POSITION = (1, 2, 3)


def interpolate_rows(t_rows: dict[int, float], rows: int) -> float:
    """Seconds of one draft step at ``rows`` rows, linear between the measured row counts and
    along the last segment beyond them."""
    xs = np.array(sorted(t_rows), dtype=np.float64)
    ys = np.array([t_rows[int(x)] for x in xs])
    if xs.size == 1:
        return float(ys[0])
    if rows <= xs[-1]:
        return float(np.interp(rows, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (rows - xs[-1]))


def simulate_rounds(ranks: np.ndarray, start: int, K: int, schedule: np.ndarray) -> tuple[int, int, int]:
    """(rounds, hits, tokens) of greedy SSD rounds over one row's continuation.

    ``ranks[i]``: the rank of the target's token ``i + 1`` among the draft's logits after
    position ``i`` (0 = the draft's argmax, i.e. its proposal is right)."""
    rounds = hits = tokens = 0
    t = start
    while t + K <= len(ranks) + 1:
        r = ranks[t - 1 : t - 1 + K]
        a = int(np.argmax(r != 0)) if (r != 0).any() else K
        if t - 1 + a >= len(ranks):
            break
        bonus_rank = int(ranks[t - 1 + a])
        hit = bonus_rank <= schedule[a] if a < K else bonus_rank < schedule[K]
        rounds, hits, tokens, t = rounds + 1, hits + int(hit), tokens + a + 1, t + a + 1
    return rounds, hits, tokens


def round_plans(
    cal, batch: int, overlap: bool, ks=range(1, K_MAX + 1), budgets: dict[int, list[int]] | None = None
) -> list[dict]:
    """Every (K, M) the calibration ``cal`` can price, with its simulated hit rate, tokens a round, round
    times and expected speedup over AR. ``budgets``: the M to try per K (default ``m·(K+1)`` for
    :data:`M_PER_POSITION`); ``overlap``: the draft builds on devices of its own."""
    c = cal.costs
    t_ar, t_rows = c.t_ar, dict(c.t_draft_rows)
    t_verify = interpolate_verify(c.t_verify)
    ranks = cal.rank_arrays()
    start = int(cal.rank_start)
    out = []
    for K in ks:
        for M in (budgets or {}).get(K) or [m * (K + 1) for m in M_PER_POSITION]:
            sched = geometric_fanout(cal.alpha, R_PRIOR, K, M)
            n = h = tok = 0
            for r in ranks:
                a, b, t = simulate_rounds(r, start, K, sched)
                n, h, tok = n + a, h + b, tok + t
            if n == 0:
                continue
            p_hit, e_tok = h / n, tok / n
            build = interpolate_rows(t_rows, batch * (K + 1)) + K * interpolate_rows(t_rows, batch * M)
            verify = t_verify[K] if K in t_verify else max(t_verify.values())
            t_hit = max(verify, build) if overlap else verify + build
            t_miss = t_hit + K * interpolate_rows(t_rows, batch)
            round_s = p_hit * t_hit + (1 - p_hit) * t_miss
            out.append(
                {
                    "k": K,
                    "budget": M,
                    "schedule": [int(f) for f in sched],
                    "hit_rate": round(p_hit, 4),
                    "tokens_per_round": round(e_tok, 4),
                    "verify_s": verify,
                    "build_s": build,
                    "round_s": round_s,
                    "expected_speedup": round(e_tok * t_ar / round_s, 4),
                }
            )
    return out


def best_plan(plans: list[dict]) -> dict:
    """The plan of the largest expected speedup; ties go to the smaller K, then the smaller M."""
    top = max(p["expected_speedup"] for p in plans)
    return min(
        (p for p in plans if p["expected_speedup"] >= top * (1 - 1e-9)), key=lambda p: (p["k"], p["budget"])
    )


def candidate_budgets(spec, ks, n_draft_devices: int) -> dict[int, list[int]]:
    """The fan-out budgets M to price per K within what ``spec`` fixes: a given budget or a uniform
    fan-out stays as given; else ``m·(K+1)`` for :data:`M_PER_POSITION`, rounded up to divide over the
    draft's devices."""
    out = {}
    for k in ks:
        if spec.fan_out != "geometric":
            out[k] = [int(spec.fan_out) * (k + 1)]
        elif spec.fan_out_budget is not None:
            out[k] = [int(spec.fan_out_budget)]
        else:
            out[k] = sorted({-(-m * (k + 1) // n_draft_devices) * n_draft_devices for m in M_PER_POSITION})
    return out


def best_ssd_plan(cal, spec, batch: int, overlap: bool, n_draft_devices: int = 1) -> dict | None:
    """SSD's best round (K, M) for ``spec`` from ``cal``, or None for a calibration without the
    draft's step at several row counts (an SD record, a drafter without ranks)."""
    if cal.costs.t_draft_rows is None or not cal.has_ranks:
        return None
    ks = range(1, K_MAX + 1) if spec.k == "auto" else [int(spec.k)]
    plans = round_plans(cal, batch, overlap, ks, candidate_budgets(spec, ks, n_draft_devices))
    return best_plan(plans) if plans else None
