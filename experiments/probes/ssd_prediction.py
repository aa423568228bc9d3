"""What the cost models predict for SSD against SD with the draft on a core of its own, before the
hardware-fair protocol measures it: run pinned to one core (``SSD_JAX_CPUS=0``), the calibration
times the target and every draft variant there (the other core is the same hardware).

    SSD_JAX_CPUS=0 .venv/bin/python experiments/probes/ssd_prediction.py [--target T] [--draft D]

Prints one JSON object: SD's chosen variant, K and expected speedup over AR; SSD's (with the
build hidden behind the verify, as on a device of its own, and without it, as on one device);
and the predicted SSD / SD ratio."""

import argparse
import functools
import json

import ssd_jax
from ssd_jax import SpecConfig
from ssd_jax.drafters.vocab import load_with_head
from ssd_jax.planning import configure


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    a = ap.parse_args()
    target = ssd_jax.load_model(a.target)
    load = functools.partial(load_with_head, dtype=target.cfg.dtype)
    draft = load(a.draft)
    out = {"cpus": ssd_jax.xla_env.cpus()}
    for name, spec in (
        ("sd", SpecConfig(method="sd", draft=draft)),
        ("ssd_own_device", SpecConfig(method="ssd", draft=draft, target_devices=1, draft_devices=1)),
        ("ssd_one_device", SpecConfig(method="ssd", draft=draft)),
    ):
        resolved, plan = configure(target, spec, rows=1, load=load)
        info = plan.k_auto
        best = info.get("ssd_plan") or {
            "k": resolved.k,
            "expected_speedup": info["expected_speedup_by_k"][str(resolved.k)],
        }
        out[name] = {
            "draft_dtype": resolved.draft_dtype,
            "draft_vocab": resolved.draft_vocab,
            "variants": (plan.draft_auto or {}).get("variants"),
            "alpha": info["alpha"],
            "costs": dict(info["costs"]),
            "plan": best,
        }
    sd = out["sd"]["plan"]["expected_speedup"]
    out["predicted_ssd_over_sd"] = {
        "own_device": out["ssd_own_device"]["plan"]["expected_speedup"] / sd,
        "one_device": out["ssd_one_device"]["plan"]["expected_speedup"] / sd,
    }
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
