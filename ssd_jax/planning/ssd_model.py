"""SSD's own round: the K, the fan-out budget M and the miss path that its cost model expects to be fastest.

SD's round model (:mod:`ssd_jax.planning.sd_model`) prices a round as ``K`` draft steps plus one verify.
An SSD round is different (docs/reference.md §4 and §6): while the target verifies ``K + 1``
tokens, the draft re-runs the round's tokens and builds ``M`` branches per row for ``K`` steps;
on a cache hit the next round's speculation is ready at once, on a miss a backup speculates first.
Pure numpy, host side, from one :class:`~ssd_jax.planning.records.Calibration`:

* hits are simulated, not assumed: on the target's greedy continuation, a round starting at
  ``t`` accepts the draft's leading matches ``a`` (teacher-forced argmax, as SD's α is
  measured), and the outcome ``(a, bonus)`` hits when the bonus's rank among the draft's own
  logits at that position is inside the branch count the geometric schedule
  (:func:`.fanout.geometric_fanout`, Theorem 12) gives bucket ``a``: rank ``≤ F_a`` below the
  cap (the rejected proposal, the draft's argmax, is never a branch), rank ``< F_K`` at it;
* the build costs ``t_d(B·(K+1))`` (the re-run) plus ``K·t_d(B·M)`` (one draft step at ``B·M``
  rows per depth), from draft steps timed at a few row counts and interpolated;
* with the draft on devices of its own (two meshes) a round costs ``max(verify, build)`` on a
  hit; on one device the two run one after the other: ``verify + build``;
* every round pays SSD's **fixed cost** (:class:`Overhead`): what an SSD round costs beyond SD's
  on a model whose compute is about zero (host work, its extra compiled calls), measured at
  start-up (:meth:`.records.Calibrator.round_overhead`). SD's own per-call cost is already in the
  stage times (each a compiled call's wall time, dispatch and sync included), so only SSD's extra
  is added, to SSD's rounds alone;
* the **miss path**, priced for both backups: the neural one re-drafts ``K`` tokens
  (``K·t_d(B)``; the next round's tokens as the draft's greedy continuation), a fast one
  (random / n-gram) costs one extra call's fixed cost and yields about one token (the round after
  a miss accepts nothing: only the bonus). At batch ``B`` a round waits for the backup unless every
  row hits (Corollary 16): the round's time weighs the hit path by ``p_hit^B``.

Expected speedup over AR: ``S = E[tokens a round]·t_ar / (q·T_hit + (1 − q)·T_miss)``, ``q = p_hit^B``.
:func:`theorem7` is the SSD paper's bound (docs/reference.md §6) from stage costs alone, for a run's
own report (:func:`run_check`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ssd_jax.analysis.sdsl import expected_tokens
from ssd_jax.analysis.speedup import predicted_speedup
from ssd_jax.decoding.spec import K_MAX
from ssd_jax.decoding.ssd.fanout import geometric_fanout
from ssd_jax.planning.sd_model import interpolate_verify

#: the miss exponent r the schedule assumes before a run has measured its own (FanoutEstimator's prior)
R_PRIOR = 0.4
#: fan-out budgets tried, in branches per acceptance position (M = m·(K + 1))
M_PER_POSITION = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Overhead:
    """Fixed seconds a round, measured where compute is about zero. ``ssd_s``: an SSD round's cost beyond
    an SD round's (added to every SSD round, hit or miss); ``fast_s``: one extra compiled call with a
    host read (what a fast backup adds on a miss)."""

    ssd_s: float = 0.0
    fast_s: float = 0.0


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


def composed_build(t_rows: dict[int, float], batch: int, K: int, M: int) -> float:
    """A build composed of draft steps: the re-run at ``batch·(K+1)`` rows, then K steps at ``batch·M``."""
    return interpolate_rows(t_rows, batch * (K + 1)) + K * interpolate_rows(t_rows, batch * M)


def measured_build_scale(costs) -> float:
    """The whole build's measured time over its composition from draft steps at the calibrated (K, M)
    (``costs.t_build``): what the tree's own work adds (top-M candidates over the vocabulary, sampling over
    every branch, the tree's attention). On the Qwen pair (0.5B draft, one core) the composition priced a
    K = 3, M = 12 build at 307 ms where it took 365 ms, and chose that budget where the build outlasted the
    verify. 1.0 for a record without the measurement."""
    tb = getattr(costs, "t_build", None)
    if not tb or not costs.t_draft_rows:
        return 1.0
    rows = max(1, int(tb["rows"]))
    composed = composed_build(dict(costs.t_draft_rows), rows, int(tb["k"]), int(tb["budget"]))
    return float(tb["s"]) / composed if composed > 0 else 1.0


def simulate_rounds(
    ranks: np.ndarray, start: int, K: int, schedule: np.ndarray, fast: bool = False
) -> tuple[int, int, int]:
    """(rounds, hits, tokens) of greedy SSD rounds over one row's continuation.

    ``ranks[i]``: the rank of the target's token ``i + 1`` among the draft's logits after
    position ``i`` (0 = the draft's argmax, i.e. its proposal is right). ``fast``: a miss is
    followed by a fast backup's round, which accepts nothing (its bonus, bucket 0, may hit)."""
    rounds = hits = tokens = 0
    t, missed = start, False
    while t + K <= len(ranks) + 1:
        r = ranks[t - 1 : t - 1 + K]
        a = int(np.argmax(r != 0)) if (r != 0).any() else K
        if fast and missed:
            a = 0
        if t - 1 + a >= len(ranks):
            break
        bonus_rank = int(ranks[t - 1 + a])
        hit = bonus_rank <= schedule[a] if a < K else bonus_rank < schedule[K]
        rounds, hits, tokens, t = rounds + 1, hits + int(hit), tokens + a + 1, t + a + 1
        missed = not hit
    return rounds, hits, tokens


def _simulate(ranks, start: int, K: int, sched, fast: bool) -> tuple[float, float] | None:
    """(hit rate, tokens a round) over every row, or None where no round fits."""
    n = h = tok = 0
    for r in ranks:
        a, b, t = simulate_rounds(r, start, K, sched, fast)
        n, h, tok = n + a, h + b, tok + t
    return None if n == 0 else (h / n, tok / n)


def round_plans(
    cal,
    batch: int,
    overlap: bool,
    ks=range(1, K_MAX + 1),
    budgets: dict[int, list[int]] | None = None,
    overhead: Overhead | None = None,
    backup: str = "neural",
) -> list[dict]:
    """Every (K, M) the calibration ``cal`` can price, with its simulated hit rate, tokens a round, round
    times and expected speedup over AR for each miss path (``miss_path``). ``budgets``: the M to try per
    K (default ``m·(K+1)`` for :data:`M_PER_POSITION`); ``overlap``: the draft builds on devices of its
    own; ``overhead``: the fixed cost a round; ``backup``: the miss path the engine runs ("neural",
    "fast", or "best": the faster of the two), whose speedup is the plan's ``expected_speedup``."""
    c, oh = cal.costs, overhead or Overhead()
    t_ar, t_rows = c.t_ar, dict(c.t_draft_rows)
    t_verify = interpolate_verify(c.t_verify)
    build_scale = measured_build_scale(c)
    ranks = cal.rank_arrays()
    start = int(cal.rank_start)
    out = []
    for K in ks:
        for M in (budgets or {}).get(K) or [m * (K + 1) for m in M_PER_POSITION]:
            sched = geometric_fanout(cal.alpha, R_PRIOR, K, M)
            sims = {
                "neural": _simulate(ranks, start, K, sched, False),
                "fast": _simulate(ranks, start, K, sched, True),
            }
            if sims["neural"] is None:
                continue
            build = build_scale * composed_build(t_rows, batch, K, M)
            verify = t_verify[K] if K in t_verify else max(t_verify.values())
            t_hit = (max(verify, build) if overlap else verify + build) + oh.ssd_s
            miss_s = {"neural": K * interpolate_rows(t_rows, batch), "fast": oh.fast_s}
            rows = {}
            for kind, sim in sims.items():
                if sim is None:
                    continue
                p_hit, e_tok = sim
                q = p_hit**batch  # the round waits for the backup unless every row hits (Corollary 16)
                round_s = q * t_hit + (1 - q) * (t_hit + miss_s[kind])
                rows[kind] = {"hit_rate": p_hit, "tokens_per_round": e_tok, "round_s": round_s,
                              "expected_speedup": round(e_tok * t_ar / round_s, 4)}  # fmt: skip
            kind = backup if backup in rows else max(rows, key=lambda k: rows[k]["expected_speedup"])
            run = rows[kind]
            out.append(
                {
                    "k": K,
                    "budget": M,
                    "batch": batch,
                    "schedule": [int(f) for f in sched],
                    "hit_rate": round(run["hit_rate"], 4),
                    "tokens_per_round": round(run["tokens_per_round"], 4),
                    "verify_s": verify,
                    "build_s": build,
                    "backup_s": miss_s["neural"],
                    "fast_s": oh.fast_s,
                    "fixed_s": oh.ssd_s,
                    "round_s": run["round_s"],
                    "backup": kind,
                    "miss_path": {k: v["expected_speedup"] for k, v in rows.items()},
                    "expected_speedup": run["expected_speedup"],
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


def miss_path_of(spec, overlap: bool) -> str:
    """The backup the plan prices as the engine's: "neural" or "fast" as given; ``auto`` is the neural
    one on one device (the engine's rule: the n-gram lookup would split the fused round) and the faster
    of the two where the draft has devices of its own ("best")."""
    if spec.backup in ("random", "ngram"):
        return "fast"
    if spec.backup == "auto" and overlap:
        return "best"
    return "neural"


def best_ssd_plan(
    cal, spec, batch: int, overlap: bool, n_draft_devices: int = 1, overhead: Overhead | None = None
) -> dict | None:
    """SSD's best round (K, M, miss path) for ``spec`` from ``cal``, or None for a calibration without
    the draft's step at several row counts (an SD record, a drafter without ranks)."""
    if cal.costs.t_draft_rows is None or not cal.has_ranks:
        return None
    ks = range(1, K_MAX + 1) if spec.k == "auto" else [int(spec.k)]
    budgets = candidate_budgets(spec, ks, n_draft_devices)
    plans = round_plans(cal, batch, overlap, ks, budgets, overhead, miss_path_of(spec, overlap))
    return best_plan(plans) if plans else None


def theorem7(
    p_hit: float,
    e_hit: float,
    e_miss: float,
    t_p: float,
    t_b: float,
    batch: int = 1,
    ar_per_verify: float = 1.0,
) -> float:
    """The SSD paper's Theorem 7 (Corollary 16 at ``batch`` rows; docs/reference.md §6): SSD's speedup over
    AR from the hit rate, tokens a round on a hit and on a miss, the build's time ``t_p`` and the
    backup's ``t_b`` in units of one target verify. No fixed cost: a bound for the stage costs given.
    ``ar_per_verify``: one AR step's time in verify units (the theorem takes 1; a run's own is
    ``t_ar / t_verify(K+1)``), which scales the result."""
    return ar_per_verify * predicted_speedup(p_hit, e_hit, e_miss, t_p, t_b, batch)


def sd_ceiling(e_hit: float, e_sd: float, t_sd: float) -> float:
    """SSD's most over SD (docs/reference.md §6): ``(1 + T_SD)·E_hit / E_SD``, SSD hiding at most the
    draft's share of SD's round (``t_sd``: K draft steps in verify units)."""
    return (1.0 + t_sd) * e_hit / e_sd


def run_check(plan: dict, metrics: dict, rows: int) -> dict | None:
    """An SSD run's report: the plan's prediction, Theorem 7's bound with the plan's calibrated stage
    costs and this run's own hit rate and tokens a round, SD's ceiling, and the measured speedup over
    AR (decode tokens/s × ``t_ar`` at the run's ``rows`` / ``rows``: AR makes ``rows`` tokens a step).
    None without an SSD round in the plan (K given by hand: nothing calibrated)."""
    pred, meas = plan.get("predicted") or {}, plan.get("measured") or {}
    rnd = pred.get("ssd_round")
    if not rnd or "cache_hit_rate" not in metrics or not meas.get("t_ar"):
        return None
    K, v, t_ar = int(rnd["k"]), float(rnd["verify_s"]), float(meas["t_ar"])
    p, e_hit, e_miss = float(metrics["cache_hit_rate"]), float(metrics["tau_hit"]), float(metrics["tau_miss"])
    e_hit = e_hit or e_miss  # a run without a hit (or a miss) has no mean of its own there
    e_miss = e_miss or e_hit
    t_p = rnd["build_s"] / v
    t_b = (rnd["fast_s"] if rnd.get("backup") == "fast" else rnd["backup_s"]) / v
    bound = theorem7(p, e_hit, e_miss, t_p, t_b, rows, t_ar / v) if e_hit else 0.0
    e_sd = float(expected_tokens(float(meas.get("alpha", 0.0)), K))
    t_sd = K * float(meas.get("t_draft_step") or 0.0) / v
    measured = float(metrics.get("decode_tokens_per_s") or 0.0) * t_ar / max(1, rows)
    out = {
        "predicted": pred.get("expected_speedup"),
        "bound": round(bound, 4),
        "bound_verify_units": round(bound * v / t_ar, 4),
        "sd_ceiling": round(sd_ceiling(e_hit, e_sd, t_sd), 4) if e_hit else None,
        "hit_rate": p, "e_hit": e_hit, "e_miss": e_miss, "t_p": round(t_p, 4), "t_b": round(t_b, 4),
        "e_sd": round(e_sd, 4), "t_sd": round(t_sd, 4), "ar_per_verify": round(t_ar / v, 4),
        "measured": round(measured, 4),
        "measured_how": "decode tokens/s x t_ar (the calibration's, at the run's rows) / rows",
    }  # fmt: skip
    out["line"] = (
        f"predicted {out['predicted']:.2f}x AR; Theorem 7 bound {bound:.2f}x with this run's hits {p:.2f}, "
        f"E_hit {e_hit:.2f}, E_miss {e_miss:.2f}, T_p {t_p:.2f}, T_b {t_b:.2f} (verify units; AR step "
        f"{t_ar / v:.2f}), at most {out['sd_ceiling'] or 0:.2f}x SD; measured {measured:.2f}x AR "
        f"(decode tok/s x t_ar {1e3 * t_ar:.2f} ms / {rows} rows)"
    )
    return out
