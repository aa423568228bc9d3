"""SSD with an EAGLE-style head: hit rate and the acceptance a tree from the head's own features keeps,
against SD with the same head, by K and fan-out budget (counts, not speed).

    python experiments/probes/eagle_ssd_hits.py --target smollm2-135m-instruct --head smollm2-135m-eagle \
        --ks 2 4 --budgets 6 16 --out experiments/results/eagle/ssd_hits_smollm2.json

Benchmark prompts (``--prompts`` per category, never training ones) in the chat template, batch 1 (each prompt alone;
per-prompt metrics averaged), ``--new-tokens`` each, greedy and T = 1. For each (K, budget, temperature) one ``generate`` call of SSD
with the head over every prompt, and one of SD with the head per (K, temperature). Reports SSD's
``cache_hit_rate`` (lookups that found the verify's outcome in the tree), ``tau_hit`` / ``tau_miss``
(tokens a round after a hit / a miss), the acceptance and tokens a round of both methods, and whether
greedy SSD emitted SD's tokens. No times: both run on one device here, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-eagle")
    ap.add_argument("--prompts", type=int, default=8, help="per category")
    ap.add_argument("--categories", nargs="+", default=["code", "chat"])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--budgets", type=int, nargs="+", default=[6, 16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from ssd_jax import SamplingParams, SpecConfig, generate, load_model
    from ssd_jax.data.prompts import load_prompts
    from ssd_jax.loading.draft import write_json_atomic

    target = load_model(a.target)
    tok = target.tokenizer
    prompts = []
    for c in a.categories:
        for p in load_prompts(c, n=a.prompts, seed=1):
            prompts.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": p["prompt"]}])))
    keep = ("cache_hit_rate", "tau_hit", "tau_miss", "acceptance_rate")

    def run(spec, sp):
        """Batch 1: each prompt alone; the per-prompt metrics averaged, the tokens kept."""
        per, toks = [], []
        for p in prompts:
            res = generate(target, [p], sp, spec)
            per.append({m: res.metrics.get(m) for m in keep})
            toks.append(res.outputs[0]["token_ids"])
        mean = {m: (sum(r[m] for r in per) / len(per) if all(isinstance(r[m], (int, float)) for r in per) else None)
                for m in keep}  # fmt: skip
        return mean, toks

    rows, t0 = [], time.perf_counter()
    for T in a.temperatures:
        sp = SamplingParams(temperature=T, max_new_tokens=a.new_tokens, ignore_eos=True, seed=0)
        for k in a.ks:
            sd, sd_toks = run(SpecConfig(method="sd", draft=a.head, k=k), sp)
            rows.append({"method": "sd", "k": k, "temperature": T, **sd})
            print(json.dumps(rows[-1]), flush=True)
            for m in a.budgets:
                res, toks = run(SpecConfig(method="ssd", draft=a.head, k=k, fan_out_budget=m), sp)
                same = toks == sd_toks if T == 0 else None
                rows.append(
                    {"method": "ssd", "k": k, "budget": m, "temperature": T, "same_tokens_as_sd": same, **res}
                )
                print(json.dumps(rows[-1]), flush=True)
    out = {"target": a.target, "head": a.head, "prompts": len(prompts), "categories": a.categories,
           "new_tokens": a.new_tokens, "rows": rows, "probe_s": time.perf_counter() - t0,
           "load": os.getloadavg()[0]}  # fmt: skip
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    write_json_atomic(a.out, out)


if __name__ == "__main__":
    main()
