"""Performance-model validation on a split declared in advance: fit on some cells, predict the others.

A *cell* is one (results file, model pair, batch size, category / part, method) group of
measured runs. Its measurement is the mean decode tok/s over prompts (a prompt's repeats
averaged first) with the 95% Student-t interval of :mod:`ssd_jax.bench.stats`, the same
statistic the benchmark protocol reports; its prediction inputs are the measured acceptance
(tokens per round, K, and for SSD the cache-hit rate and tau on hits / misses).

The split is a committed JSON file (``experiments/sweeps/perf_split.json``)::

    {"sources": [glob, ...],              # every results file to read (protocol JSONL or results JSON)
     "fit": [rule, ...],                  # cells matching any rule are the fit ("in-sample")
     "holdout": [rule, ...],              # labels for the rest (all of it is held out; first match names it)
     "fit_constants": ["step_overhead_s", "m_half"],   # the free constants of the hardware preset
     "hardware": "cpu", "context_tokens": 256}

A rule is ``{"label", "glob", "where": {field: value | [values] | {"min", "max", "not"}}}``
over the cell fields ``file``, ``target``, ``draft``, ``batch``, ``category``, ``part``,
``method``, ``kind`` (ar / sd / ngram / ssd), ``k``. A cell in no fit rule is held out, so
files that appear later fall into the held-out set without editing the split.

:func:`validate_split` fits the declared constants on the fit cells only (least squares on
log(predicted / measured)), then predicts every cell. :func:`error_summary` quotes the max
and mean absolute relative error, in-sample and out-of-sample separately, per method.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.analysis.perfmodel import (
    HARDWARE,
    Hardware,
    get_hardware,
    load_results,
    model_shape,
    predict_ar,
    predict_row,
    predict_sd,
    predict_ssd,
)
from ssd_jax.analysis.perfmodel.calibrate import method_kind
from ssd_jax.bench.stats import clustered, mean_ci
from ssd_jax.bench.sweep import read_results
from ssd_jax.errors import UserError

CELL_FIELDS = ("file", "target", "draft", "batch", "category", "part", "method", "kind", "k")
NGRAM_LOOKUP_S = 1e-4  # host n-gram lookup per round (kauto's measured c_round on this CPU: 0.1 ms)


# --- the split -------------------------------------------------------------------------------


def load_split(path: str | os.PathLike) -> dict:
    """The split file, checked: sources, fit and holdout rules, the constants to fit."""
    sp = json.loads(Path(path).read_text())
    for key in ("sources", "fit", "fit_constants"):
        if key not in sp:
            raise UserError(f"{path}: the split needs {key!r}")
    for rule in sp["fit"] + sp.get("holdout", []):
        bad = set(rule.get("where", {})) - set(CELL_FIELDS)
        if bad:
            raise UserError(
                f"{path}: unknown cell field(s) {sorted(bad)} in rule {rule} (fields: {CELL_FIELDS})"
            )
    hw = HARDWARE[sp.get("hardware", "cpu")]
    bad = [c for c in sp["fit_constants"] if not hasattr(hw, c)]
    if bad:
        raise UserError(f"{path}: unknown hardware constant(s) {bad}")
    sp.setdefault("holdout", [])
    sp.setdefault("context_tokens", 256)
    sp["_path"] = str(path)
    return sp


def _value_ok(cond: Any, v: Any) -> bool:
    if isinstance(cond, dict):
        if "min" in cond and (v is None or v < cond["min"]):
            return False
        if "max" in cond and (v is None or v > cond["max"]):
            return False
        nots = cond.get("not", [])
        return v not in (nots if isinstance(nots, list) else [nots])
    if isinstance(cond, list):
        return v in cond
    return v == cond


def matches(rule: dict, cell: dict) -> bool:
    """Whether a cell satisfies a rule: its file matches ``glob`` (if given) and every ``where`` condition."""
    if "glob" in rule and not fnmatch.fnmatch(cell["file"], rule["glob"]):
        return False
    return all(_value_ok(c, cell.get(f)) for f, c in rule.get("where", {}).items())


def assign(split: dict, cells: list[dict]) -> list[dict]:
    """Mark each cell ``in_sample`` (a fit rule matches) and give it the label of its first matching rule."""
    for c in cells:
        fit = next((r for r in split["fit"] if matches(r, c)), None)
        c["in_sample"] = fit is not None
        if fit is not None:
            c["label"] = fit.get("label", "fit")
        else:
            ho = next((r for r in split["holdout"] if matches(r, c)), None)
            c["label"] = ho.get("label", "held out") if ho else "held out (no rule: other run)"
    return cells


# --- cells from results files ------------------------------------------------------------------


def _k_from_method(method: str) -> int | None:
    for part in method.split("-"):
        if part.startswith("k") and part[1:].isdigit():
            return int(part[1:])
    return None


def _vocab_from_method(method: str) -> int | None:
    for part in method.split("-"):
        if part.startswith("v") and part[1:].isdigit():
            return int(part[1:])
    return None


def protocol_kind(method: str) -> str:
    return method.split("-")[0] if method.split("-")[0] in ("ar", "sd", "ngram", "ssd") else "sd"


def infer_k(runs: list[dict]) -> int | None:
    """K of a ``kauto`` method: the largest (tokens per round − 1) / acceptance over its runs, rounded
    (a round that proposed K tokens and accepted a of them has acceptance a/K; n-gram rounds may propose fewer)."""
    ks = [
        (r["tokens_per_round"] - 1) / r["acceptance_rate"]
        for r in runs
        if r.get("acceptance_rate") and r.get("tokens_per_round")
    ]
    return max(1, round(max(ks))) if ks else None


def protocol_cells(path: str | os.PathLike, name: str | None = None) -> list[dict]:
    """Cells of a protocol JSONL file: one per (model pair, batch, category, method)."""
    target = draft = None
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in read_results(path):
        if r.get("kind") == "env":
            target, draft = r.get("target"), r.get("draft")
        elif r.get("kind") == "run" and r.get("decode_tok_s"):
            groups[(target, draft, r["batch_size"], r["category"], r["method"])].append(r)
    cells = []
    for (target, draft, b, cat, meth), runs in groups.items():
        kind = protocol_kind(meth)
        m, lo, hi = mean_ci(clustered((r["prompt_index"], r["decode_tok_s"]) for r in runs))

        def avg(f, runs=runs):
            xs = [r[f] for r in runs if r.get(f) is not None]
            return sum(xs) / len(xs) if xs else None

        cells.append(
            {
                "file": name or str(path),
                "target": target,
                "draft": draft if kind in ("sd", "ssd") else None,
                "batch": b,
                "category": cat,
                "part": "protocol",
                "method": meth,
                "kind": kind,
                "k": (_k_from_method(meth) or infer_k(runs)) if kind != "ar" else None,
                "draft_vocab": _vocab_from_method(meth),
                "runs": len(runs),
                "prompts": len({r["prompt_index"] for r in runs}),
                "measured": m,
                "ci": (lo, hi),
                "tokens_per_round": avg("tokens_per_round"),
                "acceptance": avg("acceptance_rate"),
                "cache_hit_rate": avg("cache_hit_rate"),
                "tau_hit": avg("tau_hit"),
                "tau_miss": avg("tau_miss"),
                "load": sum((r["loadavg_before"] + r["loadavg_after"]) / 2 for r in runs) / len(runs),
                "new_tokens": runs[0].get("new_tokens"),
            }
        )
    return cells


def _two_mesh_as_results(d: dict) -> dict:
    """The two-mesh record (``ssd_two_mesh_*.json``: AR, SSD on one device, SSD on two meshes) as a results file."""
    words = d.get("command", "").split()
    arg = lambda f: words[words.index(f) + 1] if f in words else None  # noqa: E731
    rows = []
    for key, part, meth in (
        ("ar", "two-mesh", "ar"),
        ("single_device", "two-mesh", "ssd-one-device"),
        ("two_meshes", "two-mesh", "ssd-two-meshes"),
    ):
        if key in d:
            rows.append({**d[key], "suite": part, "method": meth, "category": "code", "prompt_index": 0})
    return {"suite": "ssd", "target": arg("--target"), "draft": arg("--draft"), "rows": rows}


def results_cells(path: str | os.PathLike, name: str | None = None) -> list[dict]:
    """Cells of an older results JSON (``sd`` / ``ssd`` suites, the sweeps, the two-mesh record):
    one per (part, category, temperature, batch, method); per-row predictions are averaged like the measurements."""
    res = load_results(path)
    if "two_meshes" in res:
        res = {**_two_mesh_as_results(res), "_path": res["_path"]}
    if res.get("suite") not in ("sd", "ssd"):
        return []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in res["rows"]:
        if not r.get("generated_tokens") or r["wall_s"] <= r["ttft_s"]:
            continue
        groups[
            (
                r.get("suite", ""),
                r.get("category", ""),
                float(r.get("temperature", 0.0) or 0.0),
                int(r.get("batch_size", 1)),
                r["method"],
            )
        ].append(r)
    cells = []
    for (part, cat, temp, b, meth), rows in groups.items():
        tok = [
            (r.get("prompt_index", i), (r["generated_tokens"] - b) / (r["wall_s"] - r["ttft_s"]))
            for i, r in enumerate(rows)
        ]
        m, lo, hi = mean_ci(clustered(tok))
        kind = method_kind(rows[0])
        steps = [r.get("verify_steps") for r in rows if r.get("verify_steps")]
        cells.append(
            {
                "file": name or str(path),
                "target": res["target"],
                "draft": res["draft"] if kind in ("sd", "ssd") else None,
                "batch": b,
                "category": cat if temp == 0 else f"{cat} T={temp:g}",
                "part": part,
                "method": meth,
                "kind": kind,
                "k": rows[0].get("k"),
                "runs": len(rows),
                "prompts": len({p for p, _ in tok}),
                "measured": m,
                "ci": (lo, hi),
                "tokens_per_round": (sum(r["generated_tokens"] - b for r in rows) / b / sum(steps))
                if steps
                else None,
                "acceptance": (sum(r["acceptance_rate"] for r in rows) / len(rows)) if kind != "ar" else None,
                "load": sum(r["loadavg"][0] for r in rows if r.get("loadavg")) / len(rows),
                "_res": res,
                "_rows": rows,
            }
        )
    return cells


def collect_cells(split: dict, root: str | os.PathLike = ".") -> list[dict]:
    """Every cell of every file the split's ``sources`` globs match (relative to ``root``), assigned."""
    root = Path(root)
    files = sorted({f for g in split["sources"] for f in glob.glob(str(root / g))})
    cells = []
    for f in files:
        rel = os.path.relpath(f, root)
        cells += protocol_cells(f, rel) if f.endswith(".jsonl") else results_cells(f, rel)
    return assign(split, cells)


# --- prediction and fit --------------------------------------------------------------------------


def _draft_shape(cell: dict):
    d = model_shape(cell["draft"])
    v = cell.get("draft_vocab")
    if v and v < d.vocab:  # a trimmed output head: (V - v) fewer rows of the head read per step
        d = dataclasses.replace(d, vocab=v, weight_params=d.weight_params - (d.vocab - v) * d.hidden)
    return d


def predict_cell(hw: Hardware, cell: dict, context: float = 256.0) -> float | None:
    """Predicted decode tok/s (all rows of the batch) of a cell, or None when an input is missing."""
    try:
        if "_rows" in cell:
            preds = clustered(
                (r.get("prompt_index", i), predict_row(hw, cell["_res"], r).throughput)
                for i, r in enumerate(cell["_rows"])
            )
            return sum(preds) / len(preds)
        t = model_shape(cell["target"])
        b, k, tau, kind = cell["batch"], cell.get("k"), cell.get("tokens_per_round"), cell["kind"]
        ctx = context + (cell.get("new_tokens") or 0) / 2
        if kind == "ar":
            return predict_ar(hw, t, batch=b, context=ctx).throughput
        if not k or not tau:
            return None
        if kind == "ngram":
            p = predict_sd(hw, t, t, k=k, tokens_per_round=tau, p_catch_up=0.0, batch=b, context=ctx)
            return b * tau / (p.round_s - p.parts["draft"] + NGRAM_LOOKUP_S)
        d = _draft_shape(cell)
        if kind == "sd":
            a = cell.get("acceptance") or 0.0
            return predict_sd(
                hw, t, d, k=k, tokens_per_round=tau, p_catch_up=1 - (1 - a**k) ** b, batch=b, context=ctx
            ).throughput
        if cell.get("cache_hit_rate") is None:
            return None  # SSD without a recorded hit rate: not predictable
        return predict_ssd(
            hw,
            t,
            d,
            k=k,
            fan_budget=2 * (k + 1),
            p_hit=cell["cache_hit_rate"],
            tau_hit=cell.get("tau_hit") or tau,
            tau_miss=cell.get("tau_miss") or tau,
            batch=b,
            context=ctx,
        ).throughput
    except KeyError:
        return None  # a model the perf model has no shape for


def fit_constants(
    hw: Hardware, cells: list[dict], names: list[str], context: float = 256.0, iters: int = 60
) -> tuple[Hardware, dict]:
    """Least squares on log(predicted / measured) over ``cells`` (and nothing else) for the constants ``names``
    (Levenberg-Marquardt in log space, numerical Jacobian). Returns the fitted hardware and a report."""
    cells = [c for c in cells if c["measured"] > 0 and predict_cell(hw, c, context)]
    if not cells or not names:
        return hw, {"fitted": [], "cells": len(cells)}
    y = np.log([c["measured"] for c in cells])

    def resid(x):
        h = hw.replace(**{n: float(v) for n, v in zip(names, np.exp(x))})
        return np.log([predict_cell(h, c, context) for c in cells]) - y

    x = np.log([max(getattr(hw, n), 1e-9) for n in names])
    r, lam = resid(x), 1e-2
    for _ in range(iters):
        J = np.stack([(resid(x + e) - r) / 1e-6 for e in np.eye(len(x)) * 1e-6], axis=1)
        A = J.T @ J
        step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -J.T @ r)
        r_new = resid(x + step)
        if r_new @ r_new < r @ r:
            x, r, lam = x + step, r_new, lam / 3
            if np.max(np.abs(step)) < 1e-7:
                break
        else:
            lam *= 5
            if lam > 1e8:
                break
    fitted = hw.replace(**{n: float(v) for n, v in zip(names, np.exp(x))})
    return fitted, {
        "fitted": list(names),
        "cells": len(cells),
        "rms_log_residual": float(np.sqrt(np.mean(r**2))),
    }


def validate_split(
    split_path: str | os.PathLike, hw: Hardware | None = None, root: str | os.PathLike = "."
) -> dict:
    """Fit the split's constants on its fit cells only, predict every cell, compare with the measured 95% CI."""
    split = load_split(split_path)
    base = hw or get_hardware(split.get("hardware", "cpu"))
    ctx = float(split["context_tokens"])
    cells = collect_cells(split, root)
    fitted, rep = fit_constants(base, [c for c in cells if c["in_sample"]], split["fit_constants"], ctx)
    for c in cells:
        p = predict_cell(fitted, c, ctx)
        c["predicted"] = p
        c["rel_err"] = p / c["measured"] - 1.0 if p and c["measured"] > 0 else None
        lo, hi = c["ci"]
        c["in_ci"] = None if p is None or math.isnan(lo) else bool(lo <= p <= hi)
    cells.sort(
        key=lambda c: (
            not c["in_sample"],
            c["label"],
            c["file"],
            c["part"],
            c["batch"],
            c["category"],
            ["ar", "sd", "ngram", "ssd"].index(c["kind"]),
            c["method"],
        )
    )
    return {
        "split": {k: v for k, v in split.items() if not k.startswith("_")},
        "split_path": split["_path"],
        "base": dataclasses.asdict(base),
        "hardware": dataclasses.asdict(fitted),
        "fit": rep,
        "cells": [{k: v for k, v in c.items() if not k.startswith("_")} for c in cells],
        "summary": error_summary(cells),
    }


def error_summary(cells: list[dict]) -> list[dict]:
    """Per (in-sample / out-of-sample, method kind, and ``all``): cells, predicted ones, max and mean absolute
    relative error, mean signed error, and how many predictions lie inside the measured 95% CI."""
    out = []
    for ins in (True, False):
        mine = [c for c in cells if c["in_sample"] == ins]
        for kind in ("ar", "sd", "ngram", "ssd", "all"):
            cs = [c for c in mine if kind == "all" or c["kind"] == kind]
            if not cs:
                continue
            e = np.array([c["rel_err"] for c in cs if c.get("rel_err") is not None])
            ci = [c["in_ci"] for c in cs if c.get("in_ci") is not None]
            out.append(
                {
                    "sample": "in" if ins else "out",
                    "kind": kind,
                    "cells": len(cs),
                    "predicted": int(e.size),
                    "max_abs_err": float(np.max(np.abs(e))) if e.size else None,
                    "mean_abs_err": float(np.mean(np.abs(e))) if e.size else None,
                    "mean_err": float(np.mean(e)) if e.size else None,
                    "inside_ci": sum(ci),
                    "with_ci": len(ci),
                }
            )
    return out


# --- report ------------------------------------------------------------------------------------


def _pct(x):
    return "-" if x is None else f"{100 * x:+.0f}%"


def _abs_pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def _short(name: str | None) -> str:
    if not name:
        return "-"
    return name.replace("qwen2.5-coder-", "qwen-").replace("-instruct", "").replace("smollm2-135m", "smollm2")


def render_split(v: dict) -> str:
    """The markdown of :func:`validate_split`: fitted constants, the per-cell table, the error summary."""
    return "\n".join(_fit_section(v) + _cells_section(v) + _error_section(v)) + "\n"


def _fit_section(v: dict) -> list[str]:
    """The split's fit: its rules and residual, and each constant's preset and fitted value."""
    hw, base, rep, sp = v["hardware"], v["base"], v["fit"], v["split"]
    n_in = sum(c["in_sample"] for c in v["cells"])
    consts = {
        "step_overhead_s": ("step overhead per forward", 1e3, "ms"),
        "m_half": ("GEMM m_half", 1, "tokens"),
        "host_overhead_s": ("host overhead per round", 1e3, "ms"),
        "bw_eff": ("bandwidth efficiency", 1, ""),
        "flop_eff": ("flop efficiency", 1, ""),
        "sample_s_per_logit": ("sampling per logit", 1e9, "ns"),
    }
    out = [
        f"### Fit on the declared split (`{v['split_path']}`)",
        "",
        f"Fitted on {rep['cells']} in-sample cells ({n_in} declared; rules: "
        + "; ".join(
            f"{r.get('label', 'fit')}: {r.get('glob', '*')} {json.dumps(r.get('where', {}))}"
            for r in sp["fit"]
        )
        + f"), least squares on log(predicted / measured) decode tok/s; RMS log residual "
        f"{rep.get('rms_log_residual', float('nan')):.3f}. Everything else keeps the `{sp.get('hardware', 'cpu')}` "
        f"preset's value. Context assumed for protocol cells: {sp['context_tokens']} prompt tokens + half the new "
        "tokens.",
        "",
        "| constant | preset | fitted |",
        "|---|---|---|",
    ]
    for key, (label, scale, unit) in consts.items():
        mark = " (fitted)" if key in rep["fitted"] else ""
        out.append(f"| {label}{mark} | {base[key] * scale:.3g} {unit} | {hw[key] * scale:.3g} {unit} |")
    return out


def _cells_section(v: dict) -> list[str]:
    """Predicted against measured decode tok/s, one row per cell."""
    out = [
        "",
        "### Predicted vs measured decode tok/s, per cell",
        "",
        "measured: mean over prompts (repeats averaged first) with its 95% t-interval, as the protocol reports it; "
        "decode tok/s counts all rows of a batch. predicted: from the fitted constants and the cell's measured "
        "tokens per round (SSD: hit rate, tau on hits / misses). error = predicted / measured − 1. `in CI`: the "
        "prediction lies inside the measured interval (`-`: one prompt, no interval).",
        "",
        "| sample | group | file | target / draft | b | category | method | K | prompts / runs | measured [95% CI] "
        "| predicted | error | in CI | tokens/round | load |",
        "|" + "---|" * 15,
    ]
    for c in v["cells"]:
        lo, hi = c["ci"]
        meas = f"{c['measured']:.2f}" + ("" if math.isnan(lo) else f" [{lo:.2f}, {hi:.2f}]")
        pair = _short(c["target"]) + (f" / {_short(c['draft'])}" if c.get("draft") else "")
        if c.get("draft_vocab"):
            pair += f" (v{c['draft_vocab']})"
        cat = c["category"] if c["part"] == "protocol" else f"{c['part']}: {c['category']}"
        tpr = "-" if c.get("tokens_per_round") is None else f"{c['tokens_per_round']:.2f}"
        pred = "-" if c["predicted"] is None else f"{c['predicted']:.2f}"
        inci = "-" if c["in_ci"] is None else ("yes" if c["in_ci"] else "no")
        out.append(
            f"| {'in' if c['in_sample'] else 'out'} | {c['label']} | {Path(c['file']).name} | {pair} "
            f"| {c['batch']} | {cat} | {c['method']} | {c['k'] or '-'} | {c['prompts']} / {c['runs']} | {meas} "
            f"| {pred} | {_pct(c['rel_err'])} | {inci} | {tpr} | {c['load']:.1f} |"
        )
    return out


def _error_section(v: dict) -> list[str]:
    """The absolute relative errors per sample (in / out) and method, then the held-out cells' by group."""
    out = [
        "",
        "### Error summary",
        "",
        "Absolute relative error of the predicted decode tok/s, per method; `in` = the cells the constants were "
        "fitted on, `out` = held out (declared before the validation was looked at).",
        "",
        "| sample | method | cells | predicted | max abs error | mean abs error | mean signed error "
        "| inside measured 95% CI |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in v["summary"]:
        out.append(
            f"| {s['sample']} | {s['kind']} | {s['cells']} | {s['predicted']} | {_abs_pct(s['max_abs_err'])} "
            f"| {_abs_pct(s['mean_abs_err'])} | {_pct(s['mean_err'])} | {s['inside_ci']} / {s['with_ci']} |"
        )
    by_label = defaultdict(list)
    for c in v["cells"]:
        if not c["in_sample"] and c.get("rel_err") is not None:
            by_label[c["label"]].append(c["rel_err"])
    out += [
        "",
        "Held-out cells by group of the split:",
        "",
        "| group | cells | max abs error | mean abs error | mean signed error |",
        "|---|---|---|---|---|",
    ]
    for label, es in by_label.items():
        e = np.array(es)
        out.append(
            f"| {label} | {e.size} | {_abs_pct(float(np.max(np.abs(e))))} | {_abs_pct(float(np.mean(np.abs(e))))} "
            f"| {_pct(float(np.mean(e)))} |"
        )
    return out


def update_block(doc: str | os.PathLike, text: str, name: str = "split") -> bool:
    """Replace the ``<!-- perfmodel:NAME -->`` ... ``<!-- /perfmodel:NAME -->`` block of ``doc``; False if absent."""
    body = Path(doc).read_text()
    a, b = f"<!-- perfmodel:{name} -->", f"<!-- /perfmodel:{name} -->"
    if a not in body or b not in body:
        return False
    i, j = body.index(a) + len(a), body.index(b)
    Path(doc).write_text(body[:i] + "\n" + text + body[j:])
    return True
