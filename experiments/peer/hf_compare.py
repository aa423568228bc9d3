"""Peer comparison: HF transformers (CPU torch) against ssd_jax on the same prompts and models.

transformers loads the same GGUF files as ssd_jax (dequantised to float32 by its own reader):
plain ``generate``, assisted generation (the 0.5B draft, K = 4 constant) and prompt-lookup
decoding (4 tokens). ssd_jax runs AR, SD (K = 4), n-gram SD (K = 4) and SSD in the same
process afterwards. Greedy, a fixed number of new tokens, chat-templated prompts; tok/s is
new tokens / end-to-end wall time (prefill included: that is what ``generate`` returns),
each configuration warmed up once first. Writes experiments/results/peer_hf_cpu.{json,md}.

    .venv/bin/python experiments/peer/hf_compare.py [--prompts 3] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "experiments" / "results" / "peer_hf_cpu"


def hf_runs(target_name, draft_name, prompt_ids, n_new, threads):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from ssd_jax.loading import registry

    torch.set_num_threads(threads)

    def load(name):
        path = registry.gguf_path(name)
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    torch_dtype=torch.float32).eval()

    target, draft = load(target_name), load(draft_name)
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    methods = {
        "hf generate": {},
        "hf assisted (K=4)": {"assistant_model": draft},
        "hf prompt lookup (4)": {"prompt_lookup_num_tokens": 4},
    }
    rows, outs = [], {}
    for name, kw in methods.items():
        def run(ids, n, model=target, kw=kw):
            with torch.no_grad():
                return model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      pad_token_id=0, **kw)[0, len(ids):].tolist()

        run(prompt_ids[0], 4)  # warm-up
        t = time.perf_counter()
        outs[name] = [run(ids, n_new) for ids in prompt_ids]
        wall = time.perf_counter() - t
        rows.append({"method": name, "tokens_per_s": len(prompt_ids) * n_new / wall, "wall_s": wall})
        print(f"{name}: {rows[-1]['tokens_per_s']:.2f} tok/s", file=sys.stderr)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    methods.clear()
    del target, draft
    gc.collect()
    return rows, outs, versions


def ours_runs(target_name, draft_name, prompt_ids, n_new):
    import jax

    import ssd_jax
    from ssd_jax import SamplingParams, SpecConfig, generate

    target, draft = ssd_jax.load_model(target_name, dtype="float32"), ssd_jax.load_model(draft_name, dtype="float32")
    methods = {
        "ssd_jax AR": SpecConfig(),
        "ssd_jax SD (K=4)": SpecConfig(method="sd", draft=draft, k=4),
        "ssd_jax n-gram (K=4)": SpecConfig(method="sd", draft="ngram", k=4),
        "ssd_jax SSD (K=4)": SpecConfig(method="ssd", draft=draft, k=4),
    }
    rows, outs = [], {}
    for name, spec in methods.items():
        generate(target, [prompt_ids[0]], SamplingParams(max_new_tokens=4, ignore_eos=True), spec)  # compile
        sp = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
        t = time.perf_counter()
        res = [generate(target, [ids], sp, spec) for ids in prompt_ids]
        wall = time.perf_counter() - t
        outs[name] = [r.outputs[0]["token_ids"] for r in res]
        row = {"method": name, "tokens_per_s": len(prompt_ids) * n_new / wall, "wall_s": wall}
        if "acceptance_rate" in res[0].metrics:
            row["acceptance_rate"] = sum(r.metrics["acceptance_rate"] for r in res) / len(res)
        rows.append(row)
        print(f"{name}: {row['tokens_per_s']:.2f} tok/s", file=sys.stderr)
    return rows, outs, {"jax": jax.__version__, "ssd_jax": ssd_jax.__version__}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()

    import ssd_jax
    from ssd_jax.bench.common import environment
    from ssd_jax.data.prompts import load_prompts
    from ssd_jax.decoding.batch import encode_prompts

    tok_model = ssd_jax.load_model(args.target)
    texts = [r["prompt"] for c in ("code", "chat", "math") for r in load_prompts(c, n=1)][: args.prompts]
    prompt_ids = encode_prompts(tok_model, texts, chat=True)
    del tok_model
    gc.collect()
    load0 = os.getloadavg()
    hf, hf_out, v1 = hf_runs(args.target, args.draft, prompt_ids, args.new_tokens, args.threads)
    ours, our_out, v2 = ours_runs(args.target, args.draft, prompt_ids, args.new_tokens)
    same = [a == b for a, b in zip(hf_out["hf generate"], our_out["ssd_jax AR"])]
    res = {"target": args.target, "draft": args.draft, "prompts": len(prompt_ids), "new_tokens": args.new_tokens,
           "threads": args.threads, "versions": {**v1, **v2}, "env": environment(), "loadavg_start": load0,
           "loadavg_end": os.getloadavg(), "greedy_tokens_equal_hf": same, "rows": hf + ours}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(res, indent=1))
    base_hf = hf[0]["tokens_per_s"]
    base_ours = ours[0]["tokens_per_s"]
    lines = [f"# Peer comparison: HF transformers vs ssd_jax ({args.target} / {args.draft}, CPU)", "",
             f"{len(prompt_ids)} chat-templated prompts (code, chat, math), greedy, {args.new_tokens} new tokens, "
             f"{args.threads} threads, float32 weights dequantised from the same GGUF files. tok/s = new tokens / "
             f"end-to-end wall (prefill included). Versions: {res['versions']}. Load average "
             f"{load0[0]:.2f} at start, {res['loadavg_end'][0]:.2f} at end. Greedy tokens of HF generate and "
             f"ssd_jax AR equal per prompt: {same}.", "",
             "| method | tok/s | vs HF generate | vs ssd_jax AR | acceptance |", "|---|---|---|---|---|"]
    for r in hf + ours:
        acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.2f} | {r['tokens_per_s'] / base_hf:.2f} "
                     f"| {r['tokens_per_s'] / base_ours:.2f} | {acc} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
