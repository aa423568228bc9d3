"""Markdown rendering of the performance model's tables and the generated blocks of a doc."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

from ssd_jax.analysis.perfmodel.calibrate import QUIET_LOAD, load_results, validate
from ssd_jax.analysis.perfmodel.hardware import HARDWARE, Hardware
from ssd_jax.analysis.perfmodel.roofline import Prediction
from ssd_jax.analysis.perfmodel.scenarios import (
    PAPER_P_HIT,
    PAPER_TOKENS_PER_STEP,
    paper_sensitivity,
    predict_paper,
    predict_qwen,
)


def _f(x, p=2):
    return "-" if x is None else f"{x:.{p}f}"


def _pct(x):
    return "-" if x is None else f"{100 * x:+.0f}%"


def _pct_abs(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def render_validation(v: dict) -> str:
    hw, cal = v["hardware"], v["calibration"]
    out = [
        "### Calibration (fitted constants)",
        "",
        f"Fitted: {', '.join(cal['fitted'] + (['host_overhead_s', 'sample_s_per_logit'] if 'components_from' in cal else []))}; "
        f"kept from the preset: {', '.join(cal['kept']) or 'none'}. Preset: {hw['source']}.",
        "",
        "1-token AR samples are the median step time minus the fitted host and sampling cost per step.",
        "",
        "| constant | value |",
        "|---|---|",
        f"| step overhead per forward | {hw['step_overhead_s'] * 1e3:.2f} ms |",
        f"| bandwidth efficiency | {hw['bw_eff']:.3f} ({hw['hbm_gb_s'] * hw['bw_eff']:.1f} GB/s) |",
        f"| GEMM half-performance length m_half | {hw['m_half']:.1f} tokens |",
        f"| flop efficiency | {hw['flop_eff']:.2f} |",
        f"| host overhead per round | {hw['host_overhead_s'] * 1e3:.2f} ms |",
        f"| sampling per position (151,936 logits) | {hw['sample_s_per_logit'] * 151936 * 1e3:.2f} ms |",
        "",
        f"Components from: {cal.get('components_from', '-')}.",
        "",
        "| calibration sample | model | b x T | measured ms | model ms | error |",
        "|---|---|---|---|---|---|",
    ]
    seen = defaultdict(list)
    for r in cal["residuals"]:
        seen[(r["source"], r["model"], r["batch"], r["tokens"])].append(r)
    for (src, m, b, t), rs in seen.items():
        me = statistics.mean(x["measured_s"] for x in rs)
        pr = statistics.mean(x["predicted_s"] for x in rs)
        out.append(
            f"| {src}{f' (mean of {len(rs)})' if len(rs) > 1 else ''} | {m} | {b} x {t} | {me * 1e3:.0f} "
            f"| {pr * 1e3:.0f} | {_pct(pr / me - 1)} |"
        )
    if cal.get("skipped"):
        out += ["", "Skipped: " + "; ".join(cal["skipped"])]
    out += [
        "",
        "### Predicted vs measured decode tok/s",
        "",
        "Decode tok/s = summed decode tokens / summed decode time (prefill and first token excluded), all rows "
        "of the group. `fit` marks groups whose own rows were used in the calibration. Inputs per row: measured "
        "tokens per round (and, for SSD, cache hit rate, tau hit / miss, fan-out budget). `iid α` = the same "
        "model with E[τ] from the acceptance rate by the i.i.d. formula instead of the measured tokens per round.",
        "",
        "| file | part | category | T | b | method | n | measured | predicted | error | iid α | vs AR meas "
        "| vs AR pred | vs SD meas | vs SD pred | verify/round meas / pred s | draft (exposed)/round meas / pred s "
        "| load | fit |",
        "|" + "---|" * 20,
    ]
    for r in v["groups"]:
        comp_v = f"{r['m_verify_round']:.2f} / {r['p_verify_round']:.2f}" if "m_verify_round" in r else "-"
        comp_d = f"{r['m_draft_round']:.2f} / {r['p_draft_round']:.2f}" if "m_draft_round" in r else "-"
        out.append(
            f"| {r['file']} | {r['part']} | {r['category']} | {r['temperature']:g} | {r['batch']} "
            f"| {r['method']} | {r['n']} | {r['measured']:.2f} | {r['predicted']:.2f} | {_pct(r['rel_err'])} "
            f"| {_f(r.get('predicted_iid_alpha'))} | {_f(r.get('m_vs_ar'))} | {_f(r.get('p_vs_ar'))} "
            f"| {_f(r.get('m_vs_sd'))} | {_f(r.get('p_vs_sd'))} | {comp_v} | {comp_d} | {r['load']:.1f} "
            f"| {'fit' if r['fitted'] else ''} |"
        )
    out += [
        "",
        "### Error summary",
        "",
        f"`quiet`: only the groups measured at a mean 1-minute load average ≤ {QUIET_LOAD} (the benchmark "
        "alone keeps the 2 cores at ≈ 2; more means another process competed for them).",
        "",
        "| method | batch | groups | in fit | mean abs error (tok/s) | mean error | max abs error "
        "| mean abs error of the ratio to AR | quiet groups | quiet mean abs error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in v["summary"]:
        out.append(
            f"| {s['kind']} | {s['batch']} | {s['groups']} | {'yes' if s['fitted'] else 'no'} "
            f"| {100 * s['mean_abs_err']:.0f}% | {_pct(s['mean_err'])} | {100 * s['max_abs_err']:.0f}% "
            f"| {_pct_abs(s['ratio_mean_abs_err'])} | {s['quiet_groups']} "
            f"| {_pct_abs(s['quiet_mean_abs_err'])} |"
        )
    return "\n".join(out) + "\n"


_PRED_HEAD = (
    "| method | tok/s per sequence | tok/s per device (throughput / devices) | devices | tokens/round "
    "| round ms | parts (ms per round) |"
)


def _pred_row(name: str, p: Prediction, refs: tuple = ()) -> str:
    parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in p.parts.items())
    cells = [
        name,
        f"{p.tokens_per_s:.1f}",
        f"{p.tokens_per_s_per_device:.1f}",
        str(p.devices),
        f"{p.tokens_per_round:.2f}",
        f"{p.round_s * 1e3:.2f}",
        parts,
        *refs,
    ]
    return "| " + " | ".join(cells) + " |"


def render_paper(d: dict, sens: list[dict] | None = None) -> str:
    p = d["predictions"]
    h100 = d["hardware"] == HARDWARE["h100-sxm"].name
    ref = "paper" if h100 else "paper (on H100)"
    out = [
        f"### SSD paper setting: Llama-3.1-70B (4 x {d['hardware']}, TP) + Llama-3.2-1B draft, batch 1, greedy",
        "",
        f"Acceptance: α = {d['alpha']:.3f} (the i.i.d. α giving the public reproduction's {PAPER_TOKENS_PER_STEP} "
        f"tokens/step at K=7); SD K=6 E[τ] = {p['sd'].tokens_per_round:.2f}; SSD K=7, F=3 (24 branches), p_hit = "
        f"{PAPER_P_HIT}, neural backup; draft loop: {d['draft_loop']}; 70B fits on 4 devices: {d['fits']}.",
        "",
        _PRED_HEAD + f" {ref} | model vs {ref} | public reproduction |",
        "|" + "---|" * 10,
    ]
    for m in ("ar", "sd", "ssd"):
        pr = d["paper"][m]
        out.append(
            _pred_row(
                m.upper(),
                p[m],
                (f"{pr:.1f}", _pct(p[m].tokens_per_s / pr - 1), f"{d['reproduction'][m]:.1f}"),
            )
        )
    ar, sd, ssd = (p[m].tokens_per_s for m in ("ar", "sd", "ssd"))
    pa = d["paper"]
    out += [
        "",
        f"| ratio | model | {ref} |",
        "|---|---|---|",
        f"| SD / AR | {sd / ar:.2f} | {pa['sd'] / pa['ar']:.2f} |",
        f"| SSD / AR | {ssd / ar:.2f} | {pa['ssd'] / pa['ar']:.2f} |",
        f"| SSD / SD | {ssd / sd:.2f} | {pa['ssd'] / pa['sd']:.2f} |",
        f"| SSD / SD ceiling (1 + T_SD)·E_hit/E_SD | {d['ssd_over_sd_ceiling']:.2f} | - |",
        f"| SSD / AR per device | {p['ssd'].tokens_per_s_per_device / p['ar'].tokens_per_s_per_device:.2f} "
        f"| {pa['ssd'] / 5 / (pa['ar'] / 4):.2f} |",
        "",
        f"SSD: T_p = {p['ssd'].info['T_p']:.2f} verify units (build "
        f"{'hidden' if p['ssd'].info['build_hidden'] else 'NOT hidden'}), T_b = {p['ssd'].info['T_b']:.2f}; SD: "
        f"T_SD = {p['sd'].info['T_SD']:.2f}, draft share of the round {100 * p['sd'].info['draft_share']:.0f}% "
        "(SSD can only hide this share).",
    ]
    if sens:
        out += [
            "",
            "Sensitivity (same model, one assumption changed):",
            "",
            "| assumption | AR | SD | SSD | SSD / AR | SSD / SD |",
            "|---|---|---|---|---|---|",
        ]
        for s in sens:
            q = s["d"]["predictions"]
            a, b, c = (q[m].tokens_per_s for m in ("ar", "sd", "ssd"))
            out.append(f"| {s['label']} | {a:.1f} | {b:.1f} | {c:.1f} | {c / a:.2f} | {c / b:.2f} |")
        out.append(
            f"| {ref} | {pa['ar']} | {pa['sd']} | {pa['ssd']} | {pa['ssd'] / pa['ar']:.2f} "
            f"| {pa['ssd'] / pa['sd']:.2f} |"
        )
    return "\n".join(out) + "\n"


def render_qwen(d: dict) -> str:
    p = d["predictions"]
    acc = d["acceptance"]
    out = [
        f"### Qwen2.5-Coder 1.5B target + 0.5B draft, bf16, {d['hardware']}, batch {d['batch']}",
        "",
        f"Acceptance ({acc['source']}): SD-K4 tokens/round {acc['tau_sd']:.2f}; SSD-K4 p_hit {acc['p_hit']:.2f}, "
        f"tau hit {acc['tau_hit']:.2f}, tau miss {acc['tau_miss']:.2f}; fan-out budget 10 branches.",
        "",
        _PRED_HEAD + " vs AR |",
        "|" + "---|" * 8,
    ]
    for k, name in (
        ("ar", "AR"),
        ("sd", "SD K=4"),
        ("ssd1", "SSD K=4, 1 device (serialised)"),
        ("ssd2", "SSD K=4, 2 devices"),
    ):
        out.append(_pred_row(name, p[k], (f"{p[k].tokens_per_s / p['ar'].tokens_per_s:.2f}x",)))
    out += [
        "",
        f"Two-device SSD: T_p = {p['ssd2'].info['T_p']:.2f} verify units "
        f"(build {'hidden' if p['ssd2'].info['build_hidden'] else 'NOT hidden: the draft is too slow to hide'}); "
        f"SD draft share of the round {100 * p['sd'].info['draft_share']:.0f}%.",
    ]
    return "\n".join(out) + "\n"


def render_forward_fit(hw: Hardware, rep: dict) -> str:
    out = [
        f"### Forward-time fit on {hw.name}",
        "",
        f"Fitted: {', '.join(rep['fitted'])}; kept: {', '.join(rep['kept']) or 'none'}.",
        "",
        f"step overhead {hw.step_overhead_s * 1e3:.3f} ms, bw_eff {hw.bw_eff:.3f}, flop_eff {hw.flop_eff:.3f}, "
        f"m_half {hw.m_half:.1f}",
        "",
        "| model | b x T | measured ms | model ms | error |",
        "|---|---|---|---|---|",
    ]
    for r in rep["residuals"]:
        out.append(
            f"| {r['model']} | {r['batch']} x {r['tokens']} | {r['measured_s'] * 1e3:.3f} "
            f"| {r['predicted_s'] * 1e3:.3f} | {_pct(r['predicted_s'] / r['measured_s'] - 1)} |"
        )
    return "\n".join(out) + "\n"


def render_hardware() -> str:
    out = [
        "### Hardware presets",
        "",
        "| preset | HBM GB/s | peak TFLOP/s | memory GB | bw_eff | flop_eff | m_half "
        "| step overhead ms | host ms/round | link GB/s | link latency µs | bytes/param | source |",
        "|" + "---|" * 13,
    ]
    for k, h in HARDWARE.items():
        out.append(
            f"| {k} | {h.hbm_gb_s:g} | {h.peak_tflops:g} | {h.memory_gb:g} | {h.bw_eff:.2f} | {h.flop_eff:.2f} "
            f"| {h.m_half:g} | {h.step_overhead_s * 1e3:.2f} | {h.host_overhead_s * 1e3:.2f} | {h.link_gb_s:g} "
            f"| {h.link_latency_s * 1e6:g} | {h.bytes_per_param} | {h.source} |"
        )
    return "\n".join(out) + "\n"


def jsonable(x):
    if isinstance(x, Prediction):
        return x.to_dict()
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def update_doc(path: str, validate_paths: list[str]) -> None:
    """Rewrite the generated blocks of a markdown file (``<!-- perfmodel:NAME -->`` ...
    ``<!-- /perfmodel:NAME -->``, NAME in hardware, validation, paper, qwen) with fresh output."""
    here = Path("experiments/results")
    acc = [load_results(x) for x in sorted(here.glob("sd_cpu*.json")) + sorted(here.glob("ssd_cpu*.json"))]
    fresh = {
        "hardware": render_hardware,
        "paper": lambda: render_paper(predict_paper(), paper_sensitivity(HARDWARE["h100-sxm"])),
        "qwen": lambda: (
            render_qwen(predict_qwen(results=acc)) + "\n" + render_qwen(predict_qwen(results=acc, batch=8))
        ),
    }
    if validate_paths:
        fresh["validation"] = lambda: render_validation(validate(validate_paths))
    text = Path(path).read_text()
    for name, make in fresh.items():
        a, b = f"<!-- perfmodel:{name} -->", f"<!-- /perfmodel:{name} -->"
        if a in text and b in text:
            i, j = text.index(a) + len(a), text.index(b)
            text = text[:i] + "\n" + make() + text[j:]
    Path(path).write_text(text)
