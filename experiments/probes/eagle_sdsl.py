"""Where an EAGLE-style head stands in the SDSL picture (docs/eagle.md, "Where the law stands").

    python experiments/probes/eagle_sdsl.py --out experiments/results/eagle/sdsl.json \
        --alpha smollm2-135m-instruct:head=experiments/results/eagle/acceptance_cpu_smollm2_head.json \
        --alpha smollm2-135m-instruct:draft=experiments/results/eagle/acceptance_cpu_smollm2_draft.json

For each target: the law's N_opt (ssd_jax.analysis.sdsl, the target's total parameters), a head's
trained parameters and the weights one head step reads (its layer and input map, plus the 8,192
LM head rows it keeps; ``fc`` runs once a round over the pending pairs and is counted as one more
read a round), beside the shipped draft model's. Given a measured acceptance file (``--suite
acceptance``, T = 0, all categories), the law's speedup at the measured per-token alpha (the
geometric estimate accepted / (accepted + rejections)) with the reads as N, at the best integer
gamma, next to what the engine measured (tokens a round). Configs only: no weights are read.
"""

from __future__ import annotations

import argparse
import json
import os


def head_counts(cfg, vocab: int, n_layers_read: int = 3, mlp: int | None = None) -> dict:
    import numpy as np

    from ssd_jax.drafters.eagle import head_config
    from ssd_jax.models.params import layer_specs

    D = cfg.hidden_size
    lcfg = head_config(cfg) if mlp is None else head_config(cfg).replace(intermediate_size=mlp)
    layer = sum(int(np.prod(s)) for s, _ in layer_specs(lcfg).values())
    fc, w_in = n_layers_read * D * D, 2 * D * D
    return {
        "trained": layer + fc + w_in + 3 * D,
        "reads_per_step": layer + w_in + vocab * D,
        "reads_fc_per_round": fc,
    }


def measured_alpha(path: str) -> dict:
    res = json.load(open(path))
    cell = next(c for c in res["cells"] if c["category"] == "all" and c["temperature"] == 0)
    k = cell["k"]
    rejections = cell["rounds"] - cell["histogram"][k]
    return {
        "k": k,
        "alpha_geometric": cell["accepted"] / max(cell["accepted"] + rejections, 1),
        "acceptance": cell["acceptance"],
        "tokens_per_round": cell["tokens_per_round"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"])
    ap.add_argument("--vocab", type=int, default=8192, help="the head's kept LM head rows")
    ap.add_argument("--alpha", action="append", default=[], help="TARGET:LABEL=ACCEPTANCE_JSON (repeatable)")
    ap.add_argument(
        "--mlp", action="append", default=[],
        help="TARGET=W: the head's MLP width for that target (default the target's; the shipped Qwen head: 3072)",
    )  # fmt: skip
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from ssd_jax.analysis import sdsl
    from ssd_jax.cli.sdsl import _config_of, model_params

    rows = []
    for t in a.targets:
        cfg = _config_of(t)
        M = model_params(t)["total"]
        n_opt = sdsl.n_opt(M)
        mlp = {k: int(v) for k, _, v in (m.partition("=") for m in a.mlp)}.get(t)
        h = head_counts(cfg, a.vocab, mlp=mlp)
        h["mlp"] = mlp or cfg.intermediate_size
        row = {"target": t, "M": M, "n_opt": n_opt, "head": h, "measured": {}}
        for spec in a.alpha:
            tgt, _, rest = spec.partition(":")
            label, _, path = rest.partition("=")
            if tgt != t:
                continue
            m = measured_alpha(path)
            # the reads that stand for N in the law: the head's step (fc amortised over K), or the draft's
            is_head = label.startswith("head")  # "head", or a version of it ("head_stage1")
            n = h["reads_per_step"] + h["reads_fc_per_round"] / m["k"] if is_head else None
            if n is None and t != "smollm2-135m-instruct":
                continue  # the draft model's reads are known for SmolLM2's shipped draft only
            if n is None:
                n = (
                    10.62e6 + a.vocab * cfg.hidden_size
                )  # the shipped SmolLM2 draft: 3 layers + its trimmed head
            alpha = min(max(m["alpha_geometric"], 1e-6), 1 - 1e-6)
            g = float(sdsl.best_integer_gamma(alpha, M / n))
            m.update(
                {
                    "reads_per_step": n,
                    "law_gamma": g,
                    "law_expected_tokens": float(sdsl.expected_tokens(alpha, g)),
                    "law_speedup_at_gamma": float(sdsl.speedup(alpha, g, n, M)) if g > 0 else 1.0,
                    "law_speedup_at_k": float(sdsl.speedup(alpha, m["k"], n, M)),
                }
            )
            row["measured"][label] = m
        rows.append(row)
    from ssd_jax.loading.draft import write_json_atomic

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    write_json_atomic(a.out, rows)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
