"""Probe (an anecdote, not a protocol result): stage costs of SD at batch 16 on the Qwen pair, 16 code
prompts, --profile-stages, K given on the command line (default 2); then AR on the same batch.

    python experiments/probes/b16_stage_probe.py OUT.json [K ...]
"""

import json
import os
import sys
import ssd_jax
from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.bench import protocol

t = ssd_jax.load_model("qwen2.5-coder-1.5b-instruct")
d = ssd_jax.load_model("qwen2.5-coder-0.5b-instruct")
recs = protocol.category_prompts("code", 16)
prompts = [r["prompt"] for r in recs]
sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
out = {"loadavg": os.getloadavg()}
for k in tuple(int(a) for a in sys.argv[2:]) or (2,):
    spec = SpecConfig(
        method="sd", draft=d, k=k, draft_vocab=32768, draft_dtype="bfloat16", profile_stages=True
    )
    generate(t, prompts[:16], SamplingParams(max_new_tokens=4, ignore_eos=True), spec, chat=True)  # compile
    r = generate(t, prompts[:16], sp, spec, chat=True)
    m = r.metrics
    keep = {
        x: m.get(x)
        for x in (
            "k",
            "verify_steps",
            "draft_s",
            "verify_s",
            "sample_s",
            "overhead_s",
            "prefill_s",
            "wall_s",
            "decode_tokens_per_s",
            "mean_acceptance_length",
            "acceptance_rate",
        )
    }
    out[f"sd_k{k}"] = keep
    print(k, json.dumps(keep), flush=True)
ar = generate(t, prompts[:16], sp, SpecConfig(), chat=True)
out["ar"] = {x: ar.metrics.get(x) for x in ("wall_s", "prefill_s", "decode_tokens_per_s")}
print(json.dumps(out["ar"]))
out["loadavg_end"] = os.getloadavg()
json.dump(out, open(sys.argv[1], "w"), indent=1)
