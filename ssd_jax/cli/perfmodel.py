"""``python -m ssd_jax.perfmodel`` (also ``python -m ssd_jax.perf``): the performance model's CLI.

Validation against this CPU's results, predictions for large hardware, forward-pass timing for
the GPU check, and the generated blocks of ``docs/performance.md``; the model itself is
:mod:`ssd_jax.analysis.perfmodel`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from ssd_jax.analysis import perfmodel as pm
from ssd_jax.analysis.perfmodel import HARDWARE
from ssd_jax.bench import perfsplit
from ssd_jax.cli.args import Parser


def build_parser() -> Parser:
    p = Parser(prog="python -m ssd_jax.perfmodel", description=pm.__doc__.split("\n")[0])
    p.add_argument(
        "--validate",
        nargs="+",
        metavar="RESULTS_JSON",
        help="calibrate on this CPU's results and compare predictions with the measurements",
    )
    p.add_argument(
        "--validate-split",
        metavar="SPLIT_JSON",
        help="fit on the cells a split file declares (e.g. experiments/sweeps/perf_split.json), predict the "
        "held-out ones, quote max and mean errors in- and out-of-sample",
    )
    p.add_argument("--predict", nargs="+", choices=["paper", "qwen-h200"], default=[])
    p.add_argument(
        "--hardware",
        help="the base hardware of --validate / --calibrate-forward and the hardware of "
        "--predict (" + ", ".join(HARDWARE) + ")",
    )
    p.add_argument(
        "--acceptance-from",
        nargs="*",
        metavar="RESULTS_JSON",
        help="results whose measured acceptance / hit rates feed --predict qwen-h200 "
        "(default: the SD / SSD CPU results in experiments/results that exist)",
    )
    p.add_argument("--batch", type=int, default=1, help="batch size of --predict qwen-h200")
    p.add_argument(
        "--measure", nargs="+", metavar="MODEL", help="time synthetic-weight forward passes (GPU check)"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", help="where --measure writes its rows")
    p.add_argument(
        "--calibrate-forward",
        nargs="+",
        metavar="RESULTS_JSON",
        help="fit --hardware's forward constants on --measure rows and/or AR-suite results, "
        "then use them for --predict",
    )
    p.add_argument("--show-hardware", action="store_true", help="print the hardware presets")
    p.add_argument(
        "--update-doc",
        metavar="MARKDOWN",
        help="rewrite the generated blocks of this file (e.g. "
        "docs/performance.md) with fresh tables; --validate FILES feeds its validation block",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown tables")
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    doc: dict[str, Any] = {}
    md: list[str] = []
    if a.show_hardware:
        doc["hardware"] = {k: dataclasses.asdict(h) for k, h in HARDWARE.items()}
        md.append(pm.render_hardware())
    if a.measure:
        doc["measure"] = pm.measure_forward(a.measure, dtype=a.dtype, out=a.out)
    if a.update_doc:
        return _update_doc(a)
    hw_override = pm.get_hardware(a.hardware) if a.hardware else None
    if a.validate:
        v = pm.validate(a.validate, hw_override)
        doc["validation"] = v
        md.append(pm.render_validation(v))
    if a.validate_split:
        v = perfsplit.validate_split(a.validate_split, hw_override)
        doc["validation_split"] = v
        md.append(perfsplit.render_split(v))
    if a.calibrate_forward:
        hw_override, rep = pm.calibrate_forward(a.calibrate_forward, hw_override or HARDWARE["h200"])
        doc["forward_fit"] = {"hardware": dataclasses.asdict(hw_override), **rep}
        md.append(pm.render_forward_fit(hw_override, rep))
    for what in a.predict:
        key, d, table = _predict(what, a, hw_override)
        doc[key] = d
        md.append(table)
    if not (
        a.validate or a.validate_split or a.predict or a.measure or a.calibrate_forward or a.show_hardware
    ):
        p.print_help()
        return 0
    if a.json:
        print(json.dumps(pm.jsonable(doc), indent=1))
    else:
        print("\n".join(md))
    return 0


def _update_doc(a) -> int:
    """``--update-doc``: the generated blocks of the markdown file (the split's with ``--validate-split``)."""
    pm.update_doc(a.update_doc, a.validate or [])
    if a.validate_split and not perfsplit.update_block(
        a.update_doc, perfsplit.render_split(perfsplit.validate_split(a.validate_split)), "split"
    ):
        print(f"{a.update_doc} has no <!-- perfmodel:split --> block", file=sys.stderr)
        return 1
    print(f"updated {a.update_doc}", file=sys.stderr)
    return 0


def _predict(what: str, a, hw_override) -> tuple[str, dict[str, Any], str]:
    """``--predict WHAT``: (its key in the JSON output, the prediction, its markdown table)."""
    if what == "paper":
        hw = hw_override or HARDWARE["h100-sxm"]
        d = pm.predict_paper(hw)
        sens = pm.paper_sensitivity(hw)
        return (
            "paper",
            {**d, "sensitivity": [{"label": s["label"], **s["d"]} for s in sens]},
            pm.render_paper(d, sens),
        )
    paths = a.acceptance_from
    if paths is None:
        here = Path("experiments/results")
        paths = [str(x) for x in sorted(here.glob("sd_cpu*.json")) + sorted(here.glob("ssd_cpu*.json"))]
    results = [pm.load_results(x) for x in paths]
    d = pm.predict_qwen(hw_override or HARDWARE["h200"], results=results, batch=a.batch)
    return "qwen_h200", d, pm.render_qwen(d)


if __name__ == "__main__":
    sys.exit(main())
