"""Teacher-forced greedy acceptance of a trained EAGLE-style head on held-out prompts.

    python experiments/probes/eagle_eval.py --target smollm2-135m-instruct --head runs/smollm2-135m-instruct-eagle \
        --prompts 8 --k 4 --out experiments/results/eagle/smollm2_eval.json

Benchmark prompts (code and chat, never training ones) in the chat template, the target's greedy
continuation (``--new-tokens``), and at every answer position how many of the head's K greedy proposals
match before the first miss (``ssd_jax.training.eagle_train.evaluate_head``): ``alpha_1`` (the first
proposal's acceptance) and the mean accepted of K, each with a 95% interval over sequences, and the
acceptance by position (``p_first_d_accepted``, the mean over sequences of P(the first d proposals
are all accepted)) and the tokens a round of greedy SD whose rounds start where SD's do
(``tokens_per_round``). Writes the JSON with the head's training step and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", required=True, help="a run directory or head.safetensors")
    ap.add_argument("--prompts", type=int, default=8, help="per category (code, chat)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument(
        "--prompt-seed", type=int, default=1,
        help="which held-out prompts (1: training's evaluation, 0: the ones the benchmark suites use)",
    )  # fmt: skip
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--store-curve", action="store_true",
        help="write the curve into the head's file (acceptance_by_position, what K auto reads), as training does",
    )  # fmt: skip
    a = ap.parse_args()

    from ssd_jax import load_model
    from ssd_jax.drafters import eagle
    from ssd_jax.training.eagle_train import evaluate_head, held_out_sequences

    target = load_model(a.target, dtype="float32")
    head, meta = eagle.load_head(a.head)
    spec = eagle.HeadSpec(tuple(meta["layers"]))
    t0 = time.perf_counter()
    toks, mask = held_out_sequences(target, a.prompts, a.new_tokens, seed=a.prompt_seed)
    res = evaluate_head(head, target, spec, toks, mask, k=a.k)
    out = {"target": a.target, "head": a.head, "step": meta.get("step"), "layers": meta["layers"],
           "head_params": eagle.count_head_params(head), **res,
           "new_tokens": a.new_tokens, "prompt_seed": a.prompt_seed, "eval_s": time.perf_counter() - t0,
           "load": os.getloadavg()[0]}  # fmt: skip
    if a.store_curve:
        from pathlib import Path

        p = Path(a.head)
        p = p / eagle.HEAD_WEIGHTS if p.is_dir() else p
        ids = head.pop("vocab_ids", None)
        meta = {**meta, "acceptance_by_position": res["p_first_d_accepted"], "held_out": res}
        eagle.save_head(p, head, meta, vocab_ids=ids)
    from ssd_jax.loading.draft import write_json_atomic

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    write_json_atomic(a.out, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
