"""The planner's one entry: :func:`configure` turns the user's spec into the spec the engine runs, and a
:class:`Plan` that says what was measured, what was predicted and what was chosen.

``generate()``, the server and the benchmarks (through ``generate()``) call it once per run, before the
method is built. What it decides, in order, each step reading only what the steps before it produced:

1. **the draft**: an EAGLE-style head (its K from its own acceptance curve, :mod:`.head_model`), a draft
   model, or the n-gram / random drafters;
2. **the draft's variant** (``draft_dtype`` / ``draft_vocab`` "auto", :mod:`.variants`): each variant
   worth trying is calibrated (:class:`.records.Calibrator`, cached on disk) and priced by its method's
   round model; the fastest is kept;
3. **K** (``k="auto"``): SD's S(K) (:mod:`.sd_model`) or SSD's round model (:mod:`.ssd_model`, which
   also chooses the fan-out budget and prices the miss path: the neural backup against a fast one,
   ``backup="auto"`` taking the faster where the draft has devices of its own), from the chosen
   variant's calibration and, for SSD, the fixed cost of its round measured at start-up
   (``round_timer``; :meth:`.records.Calibrator.round_overhead`);
4. **the policy** the engine asks every round (:mod:`.policy`): SD on one device re-chooses K from its
   own acceptance (per batch bucket in a server, K = 0 where nothing pays); SSD in a server runs AR
   rounds at the buckets where its timed round does not pay;
5. **AR rounds** (offline, K auto): where no configuration is predicted to beat AR by more than the
   planner's own error (:data:`.policy.SERVING_MARGIN`, the server's margin), the run runs AR rounds:
   SD on one device through its K plan (K = 0 rounds, the draft idle), SSD through its switch with every
   bucket AR (the draft idle), a method whose K is fixed (an EAGLE-style head, SD on two meshes or stage
   by stage) as the target's AR method (``generate()``). ``--k N`` always speculates.

Across processes every process measures, and all take process 0's choices (fixed K).
"""

from __future__ import annotations

import logging
import dataclasses
import time

from ssd_jax.drafters.base import check_same_tokenizer
from ssd_jax.drafters.eagle import is_eagle, load_eagle
from ssd_jax.errors import UserError
from ssd_jax.parallel.distributed import agree, multi_process
from ssd_jax.planning import reference
from ssd_jax.planning.head_model import choose_head_k
from ssd_jax.planning.policy import SERVING_MARGIN, BucketPlans, BucketSwitch, KPlan, beats_ar
from ssd_jax.planning.records import Calibration, Calibrator
from ssd_jax.planning.sd_model import best_k, interpolate_verify, speedups_of
from ssd_jax.planning.ssd_model import Overhead
from ssd_jax.planning.variants import (
    apply_variant,
    draft_variants,
    fixed_variant,
    forget_unchosen,
    measure_variants,
    ssd_best,
    two_meshes,
)

log = logging.getLogger(__name__)

__all__ = ["Plan", "configure"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run's automatic choices rest on. ``measured``: the calibration (α, stage costs, cache or
    measured, its file); ``predicted``: the models' expected speedups; ``chosen``: K, the draft's
    variant, SSD's budget, the per-bucket policy. ``k_auto`` / ``draft_auto``: the same, in the run
    metrics' older form."""

    method: str
    chosen: dict
    measured: dict | None = None
    predicted: dict | None = None
    calibration_s: float = 0.0
    k_auto: dict | None = None
    draft_auto: dict | None = None

    @property
    def ar_rounds(self) -> bool:
        """K auto found no configuration that beats AR by more than the planner's error: AR rounds."""
        return bool(self.chosen.get("ar_rounds"))

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "chosen": self.chosen,
            "measured": self.measured,
            "predicted": self.predicted,
            "calibration_s": self.calibration_s,
            "line": self.line(),
            "choice": self.choice(),
        }

    def choice(self) -> str:
        """What the run does, in a few words (the demo's column): e.g. ``sd K=3 (predicted 1.40x)``,
        ``AR rounds (predicted 0.59x)``."""
        c, p = self.chosen, self.predicted or {}
        if self.method == "ar":
            return "ar"
        if self.ar_rounds:
            return f"AR rounds (predicted {p['best_speculation']['expected_speedup']:.2f}x)"
        out = f"{self.method} K={c['k']}"
        if c.get("fan_out_budget") is not None:
            out += f" budget={c['fan_out_budget']}"
        if p.get("expected_speedup") is not None:
            out += f" (predicted {p['expected_speedup']:.2f}x)"
        return out

    def line(self) -> str:
        """One line: e.g. ``plan: sd K=4 adaptive (1: K=4 1.52x, 8: K=0 (AR)); alpha 0.71 (cache);
        t_ar 12.1 ms, t_verify(K+1) 14.0 ms, draft step 3.1 ms; expected 1.52x AR; draft bfloat16/32768``,
        or where nothing pays ``plan: ssd AR rounds: the best speculation (K=1 budget=6) is predicted at
        0.59x AR here, not above AR by more than the planner's 12% error; alpha 0.41 (cache); ...``."""
        c = self.chosen
        out = f"plan: {self.method}"
        if self.method == "ar":
            return out
        m, p = self.measured or {}, self.predicted or {}
        if self.ar_rounds:
            b = p["best_speculation"]
            cfg = f"K={b['k']}" + (f" budget={b['budget']}" if b.get("budget") is not None else "")
            out += (
                f" AR rounds: the best speculation ({cfg}) is predicted at {b['expected_speedup']:.2f}x AR here, "
                f"not above AR by more than the planner's {c.get('margin', SERVING_MARGIN):.0%} error"
            )
        else:
            out += f" K={c['k']}" + (" (auto)" if self.k_auto else " (given)")
            if c.get("by_bucket"):
                out += f" by running rows {c['by_bucket']}"
            elif c.get("adaptive"):
                out += " adaptive"
            if c.get("fan_out_budget") is not None:
                out += f" budget={c['fan_out_budget']}"
        if "alpha" in m:
            out += f"; alpha {m['alpha']:.2f} ({m['source']})"
        if "acceptance_by_position" in m:
            out += f"; head acceptance by position {[round(x, 2) for x in m['acceptance_by_position']]} ({m['source']})"
        if "t_ar" in m:
            out += f"; t_ar {1e3 * m['t_ar']:.2f} ms"
            if "t_verify" in m:
                out += f", t_verify(K+1) {1e3 * m['t_verify']:.2f} ms"
            if m.get("t_draft_step") or m.get("t_head"):
                out += f", draft step {1e3 * (m.get('t_draft_step') or m['t_head']):.2f} ms"
        if r := p.get("ar_reference"):  # SSD's processes split the cores: AR could have them all
            out += f"; {r['line']}"
        if m.get("round_overhead"):
            o = m["round_overhead"]
            out += f"; SSD fixed cost +{1e3 * max(0.0, o['ssd_s'] - o['sd_s']):.2f} ms/round over SD's ({o['source']})"
        if self.ar_rounds:
            return out
        if p.get("expected_speedup") is not None:
            out += f"; expected {p['expected_speedup']:.2f}x AR"
        if p.get("miss_path"):
            mp = p["miss_path"]
            out += "; on a miss " + ", ".join(f"{k} {v:.2f}x" for k, v in mp["speedups"].items())
            out += f" at {mp['batch']} rows: {mp['chosen']}"
        if p.get("variants"):
            dt, dv = c.get("draft_dtype") or "target dtype", c.get("draft_vocab") or "full head"
            out += f"; draft {dt}/{dv} of {len(p['variants'])} variants"
        if c.get("margin"):
            out += f"; speculating only where the predicted gain beats AR by > {c['margin']:.0%} (the model's error)"
        return out


def configure(model, spec, *, rows: int, load, buckets=(), serving: bool = False, round_timer=None):
    """(the spec the engine runs: a loaded draft as it will run, integer K, its policy; the :class:`Plan`).

    ``rows``: the batch the run's cost is measured at (a server's slots); ``load``: how a draft named by
    a string is loaded; ``buckets``: the engine's batch buckets (a plan per bucket for SD on one
    device); ``serving``: a server (SSD on one device gets its per-bucket switch); ``round_timer``:
    ``round_timer(spec)`` times AR, SD and SSD rounds where compute is about zero on ``spec``'s
    layout (seconds a round: ``ar_s``, ``sd_s``, ``ssd_s``), SSD's fixed cost (None: not priced)."""
    if is_eagle(spec.draft):
        return _configure_head(model, spec, rows, serving)
    calibrator = Calibrator(model)
    oh_s = _round_overhead(calibrator, spec, round_timer)
    spec, draft_auto, variant_s = _choose_variant(calibrator, spec, rows, load)
    spec, k_auto, cal, policy = _choose_k(calibrator, spec, rows, buckets, serving)
    if k_auto is not None and multi_process() and two_meshes(spec):  # all take process 0's K, fixed
        budget = spec.fan_out_budget
        spec = dataclasses.replace(
            spec, k=agree(spec.k), k_plan=None, fan_out_budget=None if budget is None else agree(budget)
        )
        if spec.backup in ("neural", "ngram"):  # the plan's miss path, process 0's
            spec = dataclasses.replace(spec, backup=("neural", "ngram")[agree(int(spec.backup == "ngram"))])
        if isinstance(policy, BucketSwitch):  # a server: process 0's tokens a round (the buckets' choice
            tpr = agree(round(policy.tokens_per_round * 1e6)) / 1e6  # is agreed once timed)
            policy = dataclasses.replace(policy, k=int(spec.k), tokens_per_round=tpr)
        else:
            policy = None
        k_auto["ar_rounds"] = bool(agree(int(k_auto["ar_rounds"])))  # process 0's AR rounds or not
        spec = dataclasses.replace(spec, k_plan=policy)
    if k_auto is not None and k_auto["ar_rounds"]:
        policy = _ar_rounds_policy(spec, policy, k_auto, rows, buckets)
        spec = dataclasses.replace(spec, k_plan=policy)
    spent = variant_s + (k_auto or {}).get("calibration_s", 0.0) + oh_s
    plan = _plan(spec, cal, k_auto, draft_auto, policy, spent, calibrator)
    return spec, plan


def _layout_fits(spec) -> bool:
    """Whether ``spec``'s meshes fit the devices and its budget divides over the draft's (else the run
    stops with its own error: nothing to time first)."""
    if not two_meshes(spec):
        return True
    import jax

    n_t, n_d = spec.target_devices or 1, spec.draft_devices or 1
    budget_ok = spec.fan_out_budget is None or int(spec.fan_out_budget) % n_d == 0
    return n_t + n_d <= jax.device_count() and budget_ok


def _round_overhead(calibrator: Calibrator, spec, round_timer) -> float:
    """Read or measure SSD's fixed cost a round on ``spec``'s layout into ``calibrator.overhead`` (SSD
    with something to price only; not across processes: the move between them is not timed there).
    Returns the seconds spent measuring."""
    if (
        round_timer is None
        or spec.method != "ssd"
        or spec.draft in (None, "ngram", "random")
        or "auto" not in (spec.k, spec.draft_dtype, spec.draft_vocab)
        or (multi_process() and two_meshes(spec))
        or not _layout_fits(spec)
    ):
        return 0.0
    layout = (
        {"target_devices": spec.target_devices, "draft_devices": spec.draft_devices}
        if two_meshes(spec)
        else {}
    )
    t0 = time.perf_counter()
    try:
        rec = calibrator.round_overhead(layout, lambda: round_timer(spec))
    except (UserError, ValueError, RuntimeError) as e:  # a layout the tiny rounds cannot run on: unpriced
        log.warning(f"warning: SSD's fixed cost a round not measured ({e})")
        return time.perf_counter() - t0
    calibrator.overhead = Overhead(ssd_s=max(0.0, rec["ssd_s"] - rec["sd_s"]), fast_s=rec["ar_s"])
    calibrator.overhead_record = rec
    return time.perf_counter() - t0 if rec["source"] == "measured" else 0.0


def _choose_variant(calibrator: Calibrator, spec, rows: int, load):
    """(spec with a concrete ``draft_dtype`` / ``draft_vocab`` and, for a draft model, the loaded draft
    as it will run; the ``draft_auto`` record or None; seconds spent measuring)."""
    if spec.method == "ar" or spec.draft is None or spec.draft in ("ngram", "random"):
        dt, dv = fixed_variant(spec)
        return dataclasses.replace(spec, draft_dtype=dt, draft_vocab=dv), None, 0.0
    model = calibrator.model
    draft = load(spec.draft) if isinstance(spec.draft, str) else spec.draft
    check_same_tokenizer(model, draft)
    spec = dataclasses.replace(spec, draft=draft)
    info, spent = None, 0.0
    variants = draft_variants(model, spec, draft)
    if "auto" not in (spec.draft_dtype, spec.draft_vocab) or len(variants) == 1:
        dt, dv = variants[0]
    else:
        t0 = time.perf_counter()
        measured_rows, measured = measure_variants(calibrator, spec, draft, rows, load)
        best = max(measured_rows, key=lambda r: r["expected_speedup"])
        if multi_process() and two_meshes(spec):  # a run across processes: all take process 0's choice
            best = measured_rows[agree(measured_rows.index(best))]
        dt, dv = best["draft_dtype"], best["draft_vocab"]
        forget_unchosen(draft, model, spec, (dt, dv))
        spent = time.perf_counter() - t0 if measured else 0.0
        info = {
            "chosen": {"draft_dtype": dt, "draft_vocab": dv},
            "variants": measured_rows,
            "calibration_s": spent,
        }
    spec = dataclasses.replace(spec, draft=apply_variant(draft, dt, dv, load), draft_dtype=dt, draft_vocab=dv)
    return spec, info, spent


def _choose_k(calibrator: Calibrator, spec, rows: int, buckets, serving: bool):
    """(spec with an integer K, its policy and SSD's budget; the ``k_auto`` record or None; the
    calibration or None; the policy or None)."""
    if spec.k != "auto":
        return spec, None, None, spec.k_plan
    if spec.method == "ar":
        return dataclasses.replace(spec, k=1), None, None, None  # AR ignores k
    t0 = time.perf_counter()
    draft = spec.draft if spec.draft not in ("ngram", "random") else None
    cal = calibrator.record(spec, draft, rows)
    sp = speedups_of(cal)
    k, extra = best_k(sp), {}
    if (best := ssd_best(cal, spec, rows, calibrator.overhead)) is not None:  # SSD: K, budget, miss path
        k = best["k"]
        if spec.fan_out == "geometric" and spec.fan_out_budget is None:
            spec = dataclasses.replace(spec, fan_out_budget=best["budget"])
        extra = {"ssd_plan": best, "ssd_overlap_model": two_meshes(spec), "backup_given": spec.backup}
        if multi_process() and two_meshes(spec) and reference.needed():  # split cores: AR on all of them?
            extra["ar_reference"] = reference.layout_check(calibrator.model, rows, cal.costs.t_ar, best)
        if spec.backup == "auto" and two_meshes(spec):  # the plan's miss path (on one device auto is neural)
            spec = dataclasses.replace(spec, backup="neural" if best["backup"] == "neural" else "ngram")
    policy = None
    margin = SERVING_MARGIN  # speculation only beyond the planner's own error, offline as in a server
    if spec.method == "sd":  # K re-chosen every round (K = 0 an AR round), per bucket in a server
        policy = KPlan.from_costs(cal.alpha, cal.costs, k, zero=True, margin=margin)
        if len(buckets) > 1 and not two_meshes(spec):
            policy = BucketPlans(
                tuple(_bucket_plan(calibrator, spec, draft, b, policy, rows, margin) for b in buckets)
            )
    elif serving and extra:  # SSD's K and budget fix its tree: AR rounds or K, per bucket
        policy = BucketSwitch(int(k), float(best["tokens_per_round"]), cal.alpha, margin=SERVING_MARGIN)
    info = {
        **extra,
        "alpha": cal.alpha,
        "alpha_source": cal.alpha_source,
        "costs": cal.costs.to_json(),
        "expected_speedup_by_k": {str(i): round(s, 4) for i, s in sp.items()},
        "source": cal.source,
        "cache_file": str(cal.path),
        "calibration_s": time.perf_counter() - t0 if cal.source == "measured" else 0.0,
        # offline, the whole run's choice (a server chooses per bucket, above): the best configuration
        # (SSD's round model, or SD's S(K) at the calibrated alpha) not above AR by more than the margin
        "ar_rounds": not serving and not beats_ar(best["expected_speedup"] if best else sp[k], margin),
    }
    return dataclasses.replace(spec, k=k, k_plan=policy), info, cal, policy


def _ar_rounds_policy(spec, policy, info: dict, rows: int, buckets):
    """The policy that runs a plan's AR rounds (``info["ar_rounds"]``): SD on one device, its own K plan
    (K = 0 rounds with the draft idle; a round explores now and then, as in a server); SSD, a switch with
    every batch bucket AR (the draft idle, not even prefilled); a method whose K is fixed here (SD on
    two meshes, stage by stage or with random proposals), None: ``generate()`` runs the target's AR method."""
    if spec.method == "sd" and isinstance(policy, KPlan) and not two_meshes(spec):
        if not spec.profile_stages and spec.draft != "random":
            return policy
    if spec.method == "ssd" and info.get("ssd_plan") and not spec.profile_stages:
        tpr = float(info["ssd_plan"]["tokens_per_round"])
        return BucketSwitch(
            int(spec.k), tpr, info["alpha"], zero=tuple(buckets) or (rows,), margin=SERVING_MARGIN
        )
    return None


def _bucket_plan(
    calibrator: Calibrator, spec, draft, bucket: int, full: KPlan, rows: int, margin: float = 0.0
):
    """(bucket, its plan): the calibration at ``bucket`` rows (``full``, the plan at ``rows``, for it)."""
    if bucket == rows:
        return bucket, full
    cal = calibrator.record(spec, draft, bucket)
    return bucket, KPlan.from_costs(cal.alpha, cal.costs, best_k(speedups_of(cal)), zero=True, margin=margin)


def _plan(spec, cal: Calibration | None, k_auto, draft_auto, policy, spent: float, calibrator=None) -> Plan:
    chosen = {"k": None if spec.method == "ar" else int(spec.k)}
    if spec.method != "ar":
        chosen.update(draft_dtype=spec.draft_dtype, draft_vocab=spec.draft_vocab, adaptive=policy is not None)
    if spec.method == "ssd":
        chosen["fan_out_budget"] = spec.fan_out_budget
        chosen["backup"] = spec.backup
    if isinstance(policy, BucketPlans):
        chosen["by_bucket"] = policy.summary()
    margin = policy.plans[-1][1].margin if isinstance(policy, BucketPlans) else getattr(policy, "margin", 0.0)
    if margin or k_auto is not None:  # K auto: speculation only beyond the planner's error
        chosen["margin"] = margin or SERVING_MARGIN
    measured = predicted = None
    if cal is not None:
        c = cal.costs
        tv = interpolate_verify(c.t_verify).get(int(spec.k), max(c.t_verify.values()))  # K between measured K
        measured = {
            "alpha": cal.alpha,
            "alpha_source": cal.alpha_source,
            "t_ar": c.t_ar,
            "t_verify": tv,
            "t_draft_step": c.t_draft_step,
            "source": cal.source,
            "cache_file": str(cal.path),
        }
        if getattr(calibrator, "overhead_record", None):
            measured["round_overhead"] = calibrator.overhead_record
    if k_auto is not None:
        ssd = k_auto.get("ssd_plan")
        predicted = {
            "expected_speedup": ssd["expected_speedup"]
            if ssd
            else k_auto["expected_speedup_by_k"].get(str(spec.k)),
            "expected_speedup_by_k": k_auto["expected_speedup_by_k"],
        }
        if ssd:
            predicted["ssd_round"] = ssd
            if k_auto.get("ar_reference"):
                predicted["ar_reference"] = k_auto["ar_reference"]
            predicted["miss_path"] = {
                "speedups": ssd["miss_path"],
                "batch": ssd["batch"],
                "chosen": ssd["backup"],
            }
    if k_auto is not None and k_auto.get("ar_rounds"):
        _mark_ar_rounds(chosen, predicted, spec.fan_out_budget if spec.method == "ssd" else None)
    if draft_auto is not None:
        predicted = {**(predicted or {}), "variants": draft_auto["variants"]}
    return Plan(spec.method, chosen, measured, predicted, spent, k_auto, draft_auto)


def _mark_ar_rounds(chosen: dict, predicted: dict, budget: int | None) -> None:
    """A plan that runs AR rounds: what it declined (``best_speculation``) and what it expects (1.0x AR)."""
    best = {"k": chosen["k"], "expected_speedup": predicted["expected_speedup"]}
    if budget is not None:
        best["budget"] = budget
    chosen["ar_rounds"] = True
    predicted.update(best_speculation=best, expected_speedup=1.0)


def _configure_head(model, spec, rows: int, serving: bool = False):
    """An EAGLE-style head as the draft: its K from its acceptance curve (:mod:`.head_model`); no weight
    variants (its vocabulary and dtype are fixed in training); offline, AR rounds where its best K is not
    predicted to beat AR by more than the planner's error. One-line errors for what a head does not do
    yet."""
    if spec.method not in ("sd", "ssd"):
        raise UserError(f"an EAGLE head drafts for --method sd or ssd, not {spec.method}")
    if spec.method == "ssd" and spec.backup not in ("auto", "neural"):
        raise UserError(f"SSD with an EAGLE head has the neural backup only (not --backup {spec.backup})")
    for opt, v in (("--draft-vocab", spec.draft_vocab), ("--draft-dtype", spec.draft_dtype)):
        if v not in (None, "auto"):
            raise UserError(
                f"{opt} does not apply to an EAGLE head (its vocabulary and dtype are fixed in training)"
            )
    info = None
    if spec.k == "auto":
        head, meta = load_eagle(model, spec.draft)
        k, info = choose_head_k(model, head, meta, rows)
    else:
        k = int(spec.k)
    spec = dataclasses.replace(spec, k=k, k_plan=None, draft_dtype=None, draft_vocab=None)
    measured = predicted = None
    if info is not None and "t_ar" in info:
        measured = {"acceptance_by_position": info["acceptance_by_position"], "t_ar": info["t_ar"],
                    "t_head": info["t_head"], "source": info["source"], "cache_file": info["cache_file"]}  # fmt: skip
        predicted = {
            "expected_speedup": info["expected_speedup_by_k"][str(k)],
            "expected_speedup_by_k": info["expected_speedup_by_k"],
        }
    chosen = {"k": k, "draft": "eagle head", "adaptive": False}
    if predicted is not None:  # K auto with the head's curve
        chosen["margin"] = SERVING_MARGIN
        info["ar_rounds"] = not serving and not beats_ar(predicted["expected_speedup"])
        if info["ar_rounds"]:
            _mark_ar_rounds(chosen, predicted, None)
    return spec, Plan(spec.method, chosen, measured, predicted, (info or {}).get("calibration_s", 0.0), info)
