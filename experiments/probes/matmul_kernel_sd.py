"""AR and SD decode tok/s on SmolLM2-135M with its shipped draft, the CPU matmul kernel on
against off (``ssd_jax.models.kernels``), interleaved per prompt in one process.

    python experiments/probes/matmul_kernel_sd.py --prompts 4 --tokens 48 --reps 2

"on" is what the CPU loader installs (the kernel for 2-16 rows); "off" is the same parameters
with the verify bucket on XLA's dot (no second copy of any weight). Greedy; K = 4. Per prompt
and repeat, the four runs (AR off / AR on / SD off / SD on) rotate their order. Prints the
median decode tok/s per method and the median over prompts of the paired SD/AR ratios, and
appends one JSON line to ``experiments/results/matmul_kernel_sd.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's ssd_jax, whatever is installed
TARGET = "smollm2-135m-instruct"
DRAFT = str(ROOT / "checkpoints" / "smollm2-135m-draft")


def without_kernel(model):
    from ssd_jax.models import forms as F

    fm = model.cfg.forms
    off = {
        r: F.Form(
            getattr(fm, r).layout, tuple("right" if o == "kernel" else o for o in getattr(fm, r).orders)
        )
        for r in F.ROLES
    }
    return dataclasses.replace(model, cfg=model.cfg.replace(forms=F.Forms(**off)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()

    from ssd_jax import SamplingParams, SpecConfig, generate, load_model
    from ssd_jax.data import load_prompts
    from ssd_jax.models import kernels

    assert kernels.available()
    target, draft = load_model(TARGET), load_model(DRAFT)
    assert "kernel" in target.cfg.forms.q.orders, "the CPU table does not name the kernel"
    models = {"on": (target, draft), "off": (without_kernel(target), without_kernel(draft))}
    half = (a.prompts + 1) // 2
    ps = (
        load_prompts("code", half, seed=0, max_chars=400)
        + load_prompts("chat", a.prompts - half, seed=0, max_chars=400)
    )[: a.prompts]
    sp = SamplingParams(max_new_tokens=a.tokens, ignore_eos=True)
    runs = [(meth, kern) for meth in ("ar", "sd") for kern in ("off", "on")]
    for meth, kern in runs:  # compile / warm every program once
        t, d = models[kern]
        generate(
            t,
            [ps[0]["prompt"]],
            SamplingParams(max_new_tokens=8, ignore_eos=True),
            SpecConfig(method="sd", draft=d, k=a.k) if meth == "sd" else None,
            chat=True,
        )
    rows, loads = [], [os.getloadavg()[0]]
    for r in range(a.reps):
        for i, p in enumerate(ps):
            j = (i + r) % len(runs)
            row, toks = {"prompt": p["id"], "rep": r}, {}
            for meth, kern in runs[j:] + runs[:j]:
                t, d = models[kern]
                res = generate(
                    t,
                    [p["prompt"]],
                    sp,
                    SpecConfig(method="sd", draft=d, k=a.k) if meth == "sd" else None,
                    chat=True,
                )
                row[f"{meth}_{kern}"] = res.metrics["decode_tokens_per_s"]
                toks[(meth, kern)] = res.outputs[0]["token_ids"]
            row["same_tokens"] = len({tuple(v) for v in toks.values()}) == 1
            row["load"] = os.getloadavg()[0]
            loads.append(row["load"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    med = {f"{m}_{k}": float(np.median([x[f"{m}_{k}"] for x in rows])) for m, k in runs}
    ratios = {
        "sd_on/ar_off": float(np.median([x["sd_on"] / x["ar_off"] for x in rows])),
        "sd_off/ar_off": float(np.median([x["sd_off"] / x["ar_off"] for x in rows])),
        "sd_on/sd_off": float(np.median([x["sd_on"] / x["sd_off"] for x in rows])),
        "ar_on/ar_off": float(np.median([x["ar_on"] / x["ar_off"] for x in rows])),
    }
    out = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": TARGET,
        "draft": "checkpoints/smollm2-135m-draft",
        "k": a.k,
        "tokens": a.tokens,
        "reps": a.reps,
        "median_decode_tok_s": med,
        "median_paired_ratios": ratios,
        "load": [min(loads), max(loads)],
        "all_same_tokens": all(x["same_tokens"] for x in rows),
        "rows": rows,
    }
    with open(ROOT / "experiments" / "results" / "matmul_kernel_sd.jsonl", "a") as f:
        f.write(json.dumps(out) + "\n")
    print(
        json.dumps(
            {k: out[k] for k in ("median_decode_tok_s", "median_paired_ratios", "load", "all_same_tokens")}
        )
    )


if __name__ == "__main__":
    main()
