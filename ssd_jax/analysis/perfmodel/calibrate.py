"""Calibration and validation of the performance model against measured results files.

:func:`fit_forward` fits a preset's forward-time constants to timed forward passes;
:func:`calibrate_from_results` does it on a stated subset of this CPU's benchmark results
and :func:`validate` then predicts every AR / SD / SSD group of those results and reports
predicted against measured (see :mod:`ssd_jax.analysis.perfmodel`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.analysis.perfmodel.hardware import HARDWARE, Hardware
from ssd_jax.analysis.perfmodel.roofline import (
    Prediction,
    forward_time,
    predict_ar,
    predict_sd,
    predict_ssd,
    sample_time,
)
from ssd_jax.analysis.perfmodel.shapes import ModelShape, model_shape
from ssd_jax.analysis.sdsl import expected_tokens
from ssd_jax.models.config import ModelConfig

# --- calibration ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ForwardSample:
    """A measured forward pass (seconds), for fitting."""

    model: ModelShape
    batch: int
    tokens: int
    context: float
    seconds: float
    source: str = ""


def fit_forward(
    hw: Hardware, samples: list[ForwardSample], *, fit_flops: bool = True
) -> tuple[Hardware, dict]:
    """Fit the forward-time constants of ``hw`` to measured forward passes.

    1. 1-token samples: ``t = step_overhead + W/(BW·bw_eff)`` by least squares over models
       (with one model only ``bw_eff`` is fitted, the overhead kept).
    2. multi-token samples the memory term cannot explain (> 10% above it) are compute-side:
       ``(t − step_overhead)·FLOPS/(2N) = (x + m_half)/flop_eff`` with ``x = M + attention
       FLOPs/(2N)`` - a line in x; with two or more distinct token counts M it gives
       ``flop_eff`` and ``m_half``, with one only ``m_half`` (``flop_eff`` kept).
    Returns the fitted hardware and a report of what was fitted on what.
    """
    rep: dict[str, Any] = {"fitted": [], "kept": []}
    it = hw.bytes_per_param
    ones = [s for s in samples if s.batch * s.tokens == 1]
    multi = [s for s in samples if s.batch * s.tokens > 1]
    if ones:
        x = np.array(
            [
                (s.model.weight_bytes(it) + s.context * s.model.kv_bytes_per_token(it)) / (hw.hbm_gb_s * 1e9)
                for s in ones
            ]
        )
        y = np.array([s.seconds for s in ones])
        if len({s.model.name for s in ones}) >= 2:
            A = np.stack([np.ones_like(x), x], axis=1)
            (c, inv_eff), *_ = np.linalg.lstsq(A, y, rcond=None)
            if c < 0:
                c, inv_eff = 0.0, float(np.sum(x * y) / np.sum(x * x))
            hw = hw.replace(step_overhead_s=float(c), bw_eff=float(1.0 / inv_eff))
            rep["fitted"] += ["step_overhead_s", "bw_eff"]
        else:
            hw = hw.replace(bw_eff=float(np.mean(x / np.maximum(y - hw.step_overhead_s, 1e-12))))
            rep["fitted"] += ["bw_eff"]
            rep["kept"] += ["step_overhead_s"]
    comp = []
    for s in multi:
        f = forward_time(hw.replace(m_half=0.0), s.model, batch=s.batch, tokens=s.tokens, context=s.context)
        if s.seconds > 1.1 * (hw.step_overhead_s + f.memory):
            # (t - c)·FLOPS / 2N = (x + m_half) / flop_eff with x = M + attention FLOPs / 2N
            attn = 4.0 * s.batch * s.tokens * s.context * s.model.layers * s.model.heads * s.model.head_dim
            two_n = 2.0 * s.model.weight_params
            comp.append(
                (
                    s.batch * s.tokens + attn / two_n,
                    (s.seconds - hw.step_overhead_s) * hw.peak_tflops * 1e12 / two_n,
                )
            )
    rep["compute_side_samples"] = len(comp)
    if comp:
        Ms = np.array([c[0] for c in comp], float)
        ys = np.array([c[1] for c in comp])
        if fit_flops and len({round(m) for m in Ms.tolist()}) >= 2:
            slope, icpt = np.polyfit(Ms, ys, 1)  # y = x/eff + m_half/eff
            eff = 1.0 / slope
            hw = hw.replace(flop_eff=float(eff), m_half=float(max(0.0, icpt * eff)))
            rep["fitted"] += ["flop_eff", "m_half"]
        else:
            hw = hw.replace(m_half=float(max(0.0, np.mean(ys * hw.flop_eff - Ms))))
            rep["fitted"] += ["m_half"]
            rep["kept"] += ["flop_eff"]
    rep["residuals"] = [
        {
            "model": s.model.name,
            "batch": s.batch,
            "tokens": s.tokens,
            "measured_s": s.seconds,
            "predicted_s": forward_time(hw, s.model, batch=s.batch, tokens=s.tokens, context=s.context).total,
            "source": s.source,
        }
        for s in samples
    ]
    return hw, rep


# --- results files --------------------------------------------------------------------------


def load_results(path: str | os.PathLike) -> dict:
    with open(path) as f:
        res = json.load(f)
    res["_path"] = str(path)
    return res


def itemsize(row: dict, default: int) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(row.get("dtype", ""), default)


def median(xs):
    return float(statistics.median(xs))


def is_ngram(r: dict) -> bool:
    return str(r.get("draft", "")) == "ngram" or str(r.get("method", "")).startswith("ngram")


def calibrate_from_results(results: list[dict], hw: Hardware) -> tuple[Hardware, dict]:
    """Fit the CPU constants on a stated subset of the results (see :func:`validate`).

    * host overhead per round, sampling cost per logit and the verify forward of K+1 tokens:
      the batch-1 n-gram SD rows (their draft is a host lookup costing ~1 ms per round), or,
      when no n-gram rows are given, the verify components of the batch-1 SD rows;
    * step overhead and bandwidth efficiency: the AR suite's 1-token step times (median of
      the repeats) of every model, minus the host and sampling cost just fitted.
    """
    report: dict[str, Any] = {}
    comp_rows, comp_src = [], ""
    for res in results:
        if res.get("suite") not in ("sd", "ssd"):
            continue
        ng = [r for r in res["rows"] if is_ngram(r) and r.get("batch_size", 1) == 1 and r.get("verify_steps")]
        comp_rows += [(res, r) for r in ng]
    comp_src = "n-gram SD rows (batch 1): verify_s, sample_s, overhead_s per round"
    if not comp_rows:
        for res in results:
            if res.get("suite") in ("sd", "ssd"):
                comp_rows += [
                    (res, r)
                    for r in res["rows"]
                    if r.get("method", "").startswith("sd")
                    and r.get("batch_size", 1) == 1
                    and r.get("verify_steps")
                ]
        comp_src = "SD rows (batch 1): verify_s, sample_s, overhead_s per round (no n-gram rows given)"
    if comp_rows:
        host = median([r["overhead_s"] / r["verify_steps"] for _, r in comp_rows])
        spl = median(
            [
                r["sample_s"] / r["verify_steps"] / ((r["k"] + 1) * model_shape(res["target"]).vocab)
                for res, r in comp_rows
            ]
        )
        hw = hw.replace(host_overhead_s=host, sample_s_per_logit=spl)
        report["components_from"] = f"{comp_src} ({len(comp_rows)} rows)"
    samples: list[ForwardSample] = []
    for res in results:
        if res.get("suite") == "ar":
            for r in res["rows"]:
                m = model_shape(r["model"])
                t = median(r.get("tpot_s_all") or [r["tpot_s"]])
                t -= hw.host_overhead_s + sample_time(hw, m, 1)
                samples.append(ForwardSample(m, 1, 1, 64.0, t, f"{Path(res['_path']).name}: AR step"))
        if res.get("suite") == "forward":
            samples += forward_samples(res)
    for res, r in comp_rows:
        m = model_shape(res["target"])
        samples.append(
            ForwardSample(
                m,
                1,
                r["k"] + 1,
                r.get("prompt_tokens", 0) + r["generated_tokens"] / 2,
                r["verify_s"] / r["verify_steps"],
                f"{Path(res['_path']).name}: {r['method']} verify",
            )
        )
    hw, rep = fit_forward(hw, samples)
    report.update(rep)
    return hw, report


def forward_samples(res: dict) -> list[ForwardSample]:
    out = []
    for r in res["rows"]:
        m = ModelShape.from_config(r["model"], ModelConfig.from_dict(r["config"]))
        out.append(
            ForwardSample(
                m,
                r["batch"],
                r["tokens"],
                r["context"],
                r["seconds"],
                f"{Path(res.get('_path', 'forward')).name}: forward",
            )
        )
    return out


def group_key(r: dict) -> tuple:
    return (
        r.get("suite", ""),
        r.get("category", ""),
        float(r.get("temperature", 0.0) or 0.0),
        int(r.get("batch_size", 1)),
        r["method"],
    )


def method_kind(r: dict) -> str:
    m = r["method"]
    if m == "ar":
        return "ar"
    if "cache_hit_rate" in r or m.startswith("ssd"):
        return "ssd"
    return "ngram" if is_ngram(r) else "sd"


def predict_row(hw: Hardware, res: dict, r: dict, *, iid_alpha: bool = False) -> Prediction:
    """The model's prediction for one measured results row, from its acceptance / hit inputs only."""
    target = model_shape(res["target"])
    b = int(r.get("batch_size", 1))
    ctx = r.get("prompt_tokens", 0) / b + r["generated_tokens"] / b / 2
    kind = method_kind(r)
    if kind == "ar":
        return predict_ar(hw, target, batch=b, context=ctx)
    k = int(r["k"])
    steps = r["verify_steps"]
    tau = (r["generated_tokens"] - b) / steps / b  # measured tokens per round per row
    hist = r.get("acceptance_histogram")
    p_all = hist[-1] / sum(hist) if hist and sum(hist) else None
    if kind == "ngram":
        # the draft is a host lookup: its (tiny) measured cost stands in for a draft model
        p = predict_sd(hw, target, target, k=k, tokens_per_round=tau, p_catch_up=0.0, batch=b, context=ctx)
        t = p.round_s - p.parts["draft"] + r["draft_s"] / steps
        return Prediction("ngram", tau / t, b, 1, tau, t, {**p.parts, "draft": r["draft_s"] / steps})
    draft = model_shape(res["draft"])
    if kind == "sd":
        if iid_alpha:
            a = r["acceptance_rate"]
            return predict_sd(hw, target, draft, k=k, alpha=a, batch=b, context=ctx)
        pc = 1.0 - (1.0 - p_all) ** b if p_all is not None else None
        return predict_sd(hw, target, draft, k=k, tokens_per_round=tau, p_catch_up=pc, batch=b, context=ctx)
    fan = r.get("fanout") or {}
    budget = int(fan.get("budget") or 2 * (k + 1))
    dev = r.get("devices") or {}
    shared = bool(dev.get("single_device", True)) or hw.shared_draft
    calls = r.get("fallback_calls") or {}
    backup = (
        "neural"
        if r.get("backup", "neural") == "neural"
        or (r.get("backup") == "auto" and calls.get("neural", 0) >= calls.get("ngram", 0))
        else "fast"
    )
    p_hit = float(r["cache_hit_rate"])
    t_hit = r["tau_hit"] if r.get("tau_hit") else tau
    t_miss = r["tau_miss"] if r.get("tau_miss") else tau
    if iid_alpha:
        t_hit = t_miss = expected_tokens(r["acceptance_rate"], k)
    return predict_ssd(
        hw,
        target,
        draft,
        k=k,
        fan_budget=budget,
        p_hit=p_hit,
        tau_hit=t_hit,
        tau_miss=t_miss,
        backup=backup,
        batch=b,
        context=ctx,
        draft_devices=max(1, int(dev.get("draft", 1) or 1)),
        shared=shared,
    )


def validate(paths: list[str], hw: Hardware | None = None) -> dict:
    """Calibrate on the stated subset of ``paths``, predict every AR / SD / SSD group, compare.

    Returns ``{"hardware", "calibration", "groups", "summary"}``; each group has measured and
    predicted decode tok/s (summed decode tokens over summed decode time, prefill excluded,
    as the bench reports), the relative error, the ratios to AR (and SD) of the same group,
    per-round component times, and ``fitted`` = whether its own rows were in the fit.
    """
    hw = hw or HARDWARE["cpu"]
    results = [load_results(p) for p in paths]
    hw, cal = calibrate_from_results(results, hw)
    groups: dict[tuple, dict] = {}
    for res in results:
        if res.get("suite") not in ("sd", "ssd"):
            continue
        try:
            model_shape(res["target"]), model_shape(res["draft"])
        except KeyError as e:
            cal.setdefault("skipped", []).append(f"{res['_path']}: {e}")
            continue
        for r in res["rows"]:
            if not r.get("generated_tokens") or r["wall_s"] <= r["ttft_s"]:
                continue
            key = (Path(res["_path"]).name,) + group_key(r)
            _add_to_group(groups.setdefault(key, defaultdict(float)), hw, res, r)
    out = [_group_row(key, g) for key, g in groups.items()]
    _add_ratios(out)
    out.sort(
        key=lambda r: (
            r["file"],
            r["part"],
            r["batch"],
            r["category"],
            r["temperature"],
            ["ar", "sd", "ngram", "ssd"].index(r["kind"]),
            r["method"],
        )
    )
    return {"hardware": dataclasses.asdict(hw), "calibration": cal, "groups": out, "summary": _summary(out)}


def _add_to_group(g: defaultdict, hw: Hardware, res: dict, r: dict) -> None:
    """Adds row ``r`` of results ``res`` to its group's sums: measured and predicted decode time (prefill
    excluded) and, for SD / SSD rows with round counts, the measured and predicted verify / draft time."""
    b = int(r.get("batch_size", 1))
    dtok = r["generated_tokens"] - b
    dwall = r["wall_s"] - r["ttft_s"]
    p = predict_row(hw, res, r)
    steps = r.get("verify_steps") or r.get("steps") or max(1, dtok // b)
    g["n"] += 1
    g["dtok"] += dtok
    g["dwall"] += dwall
    g["pwall"] += dtok / p.throughput
    if r["method"] != "ar" and "verify_steps" in r:
        pa = predict_row(hw, res, r, iid_alpha=True)
        g["pwall_iid"] += dtok / pa.throughput
        g["steps"] += steps
        g["m_verify"] += r["verify_s"]
        g["p_verify"] += steps * p.parts["verify"]
        dr = r.get("draft_exposed_s", r.get("draft_s", 0.0))
        g["m_draft"] += dr
        g["p_draft"] += steps * p.parts.get("draft_exposed", p.parts.get("draft", 0.0))
    g["load"] += r["loadavg"][0] if r.get("loadavg") else 0.0
    g["kind"] = method_kind(r)


def _group_row(key: tuple, g: dict) -> dict:
    """A group's row of :func:`validate`: measured and predicted decode tok/s from its sums."""
    meas, pred = g["dtok"] / g["dwall"], g["dtok"] / g["pwall"]
    row = {
        "file": key[0],
        "part": key[1],
        "category": key[2],
        "temperature": key[3],
        "batch": key[4],
        "method": key[5],
        "kind": g["kind"],
        "n": int(g["n"]),
        "measured": meas,
        "predicted": pred,
        "rel_err": pred / meas - 1.0,
        "load": g["load"] / g["n"],
        "fitted": g["kind"] == "ngram" and key[4] == 1,
    }
    if g.get("pwall_iid"):
        row["predicted_iid_alpha"] = g["dtok"] / g["pwall_iid"]
    if g.get("steps"):
        row.update(
            m_verify_round=g["m_verify"] / g["steps"],
            p_verify_round=g["p_verify"] / g["steps"],
            m_draft_round=g["m_draft"] / g["steps"],
            p_draft_round=g["p_draft"] / g["steps"],
        )
    return row


def _add_ratios(out: list[dict]) -> None:
    """Each SD / SSD group's measured and predicted ratio to the AR group of the same setting (and an SSD
    group's to the SD one)."""
    idx = {(r["file"], r["part"], r["category"], r["temperature"], r["batch"], r["method"]): r for r in out}
    for r in out:
        base = idx.get((r["file"], r["part"], r["category"], r["temperature"], r["batch"], "ar"))
        if base and r["method"] != "ar":
            r["m_vs_ar"], r["p_vs_ar"] = r["measured"] / base["measured"], r["predicted"] / base["predicted"]
            r["ratio_err"] = r["p_vs_ar"] / r["m_vs_ar"] - 1.0
        if r["kind"] == "ssd":
            sd = [
                x
                for x in out
                if x["kind"] == "sd"
                and (x["file"], x["part"], x["category"], x["temperature"], x["batch"])
                == (r["file"], r["part"], r["category"], r["temperature"], r["batch"])
            ]
            if sd:
                r["m_vs_sd"], r["p_vs_sd"] = (
                    r["measured"] / sd[0]["measured"],
                    r["predicted"] / sd[0]["predicted"],
                )


# 1-minute load average at or below which a group counts as measured on a quiet machine: the
# benchmark itself keeps both cores busy (load ≈ 2); above that another process competed.
QUIET_LOAD = 2.5


def _summary(groups: list[dict]) -> list[dict]:
    rows = []
    for kind in ("ar", "sd", "ssd", "ngram"):
        for b1 in (True, False):
            gs = [g for g in groups if g["kind"] == kind and (g["batch"] == 1) == b1]
            if not gs:
                continue
            e = np.array([g["rel_err"] for g in gs])
            re_ = np.array([g["ratio_err"] for g in gs if "ratio_err" in g])
            quiet = np.array([g["rel_err"] for g in gs if g["load"] <= QUIET_LOAD])
            rows.append(
                {
                    "kind": kind,
                    "batch": "1" if b1 else ">1",
                    "groups": len(gs),
                    "fitted": any(g["fitted"] for g in gs),
                    "mean_abs_err": float(np.mean(np.abs(e))),
                    "mean_err": float(np.mean(e)),
                    "max_abs_err": float(np.max(np.abs(e))),
                    "ratio_mean_abs_err": float(np.mean(np.abs(re_))) if re_.size else None,
                    "quiet_groups": int(quiet.size),
                    "quiet_mean_abs_err": float(np.mean(np.abs(quiet))) if quiet.size else None,
                }
            )
    return rows


def calibrate_forward(paths: list[str], base: Hardware) -> tuple[Hardware, dict]:
    """Fit ``base``'s forward constants on ``--measure`` rows and/or AR-suite results files.

    A forward file contributes its timed passes; an AR file its 1-token step times (median
    of the repeats, minus ``base``'s host overhead per round) at context 64, and its dtype.
    """
    samples: list[ForwardSample] = []
    for path in paths:
        res = load_results(path)
        if res.get("suite") == "forward":
            samples += forward_samples(res)
        elif res.get("suite") == "ar":
            for r in res["rows"]:
                m = model_shape(r["model"])
                t = median(r.get("tpot_s_all") or [r["tpot_s"]]) - base.host_overhead_s
                base = base.replace(bytes_per_param=itemsize(r, base.bytes_per_param))
                samples.append(ForwardSample(m, 1, 1, 64.0, t, Path(path).name + ": AR step"))
    return fit_forward(base, samples)
