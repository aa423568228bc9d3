"""Before / after the one engine: the same generate() calls on two checkouts, interleaved.

Usage: python experiments/probes/engine_before_after.py BEFORE_TREE AFTER_TREE OUT.json [--repeats 3]

Each repeat runs, for each checkout in turn (a fresh process each, so both import their own ssd_jax),
AR, SD and SSD on SmolLM2-135M-Instruct with its shipped draft (K fixed at 3, so both checkouts run
the same algorithm) over the chat prompts at batch 1 (one prompt per call) and batch 8 (all
prompts in one call), greedy, 32 new tokens; it records decode and end-to-end tokens/s of every
call. The ratio after/before is reported per method and batch with a bootstrap 95% interval.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
from ssd_jax import SamplingParams, SpecConfig, generate, load_model
from ssd_jax.data import prompt_set
prompts = [p["prompt"] if isinstance(p, dict) else p for p in prompt_set("chat")][:8]
target = load_model("smollm2-135m-instruct")
draft = load_model("smollm2-135m-draft")
sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
specs = {"ar": SpecConfig(), "sd": SpecConfig(method="sd", draft=draft, k=3, draft_dtype=None, draft_vocab=None),
         "ssd": SpecConfig(method="ssd", draft=draft, k=3, backup="neural", draft_dtype=None, draft_vocab=None)}
out = []
for name, spec in specs.items():
    generate(target, prompts[:1], sp, spec, chat=True)  # compile
    generate(target, prompts, sp, spec, chat=True)
    for p in prompts:
        m = generate(target, [p], sp, spec, chat=True).metrics
        out.append({"method": name, "batch": 1, "decode": m["decode_tokens_per_s"], "e2e": m["tokens_per_s"]})
    m = generate(target, prompts, sp, spec, chat=True).metrics
    out.append({"method": name, "batch": 8, "decode": m["decode_tokens_per_s"], "e2e": m["tokens_per_s"]})
print("RESULT " + json.dumps({"load": os.getloadavg()[0], "runs": out}))
"""


def run(tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=tree, env=env, capture_output=True, text=True)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        raise SystemExit(f"child failed in {tree}: {r.stderr[-2000:]}")
    return json.loads(line[-1][7:])


def main() -> None:
    before, after, out = sys.argv[1:4]
    repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 3
    rec = {"before": [], "after": []}
    for _ in range(repeats):
        for name, tree in (("before", before), ("after", after)):
            rec[name].append(run(tree))
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
