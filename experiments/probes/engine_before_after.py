"""Before / after a change of the engine: the same generate() calls on two checkouts, interleaved.

    python experiments/probes/engine_before_after.py --before TREE --after TREE --pair smollm2 --out FILE.json

Two worker processes, one per checkout (each imports its own ``ssd_jax``), load the models once and
wait on stdin; the driver sends them the same calls alternately (the order of the two shuffled per
call, the idle worker blocked on its pipe), so both see the same machine state. For each repeat,
category and prompt (batch 1), or category (batch 8: the category's 8 prompts in one call), it runs
AR, SD and SSD on both checkouts and records decode and end-to-end tokens/s. Last, the host cost on a
tiny random model (2 layers, vocabulary 128), where a step is almost all host work: seconds per AR
step and per SD round at batch 1, 40 repeats each, interleaved likewise.

Every configuration is fixed (no K auto: the two checkouts run the same algorithm with the same K,
draft dtype and head), greedy, chat-templated prompts. The JSON holds every call.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

PAIRS = {
    # target, draft, SD K, SSD (K, fan-out budget), draft dtype
    "smollm2": ("smollm2-135m-instruct", "smollm2-135m-draft", 3, (2, 6), None),
    "qwen": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", 4, (3, 4), "bfloat16"),
}

WORKER = r"""
import json, sys, time
sys.path.insert(0, "tests")
import ssd_jax
from ssd_jax import SamplingParams, SpecConfig, generate, load_model
from ssd_jax.data.prompts import load_prompts
target_name, draft_name, k_sd, k_ssd, m_ssd, dtype, new = json.loads(sys.argv[1])
target, draft = load_model(target_name), load_model(draft_name)
kw = dict(draft=draft, draft_vocab=None, draft_dtype=dtype)
specs = {"ar": SpecConfig(), "sd": SpecConfig(method="sd", k=k_sd, **kw),
         "ssd": SpecConfig(method="ssd", k=k_ssd, fan_out_budget=m_ssd, backup="neural", **kw),
         "sd_prof": SpecConfig(method="sd", k=k_sd, profile_stages=True, **kw)}
from test_sd import tiny_model
tiny, tiny_d = tiny_model(0), tiny_model(1, scale=0.16)
tiny_specs = {"tiny_ar": SpecConfig(), "tiny_sd": SpecConfig(method="sd", draft=tiny_d, k=3, draft_vocab=None, draft_dtype=None)}
prompts = {c: [r["prompt"] for r in load_prompts(c, n=8)] for c in ("code", "chat")}
sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
print(json.dumps({"ready": ssd_jax.__file__}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["method"].startswith("tiny"):
        m = generate(tiny, [[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=64, ignore_eos=True), tiny_specs[cmd["method"]]).metrics
        steps = m.get("verify_steps") or (m.get("steps", 1) - 1)
        print(json.dumps({"s_per_step": (m["wall_s"] - m["ttft_s"]) / max(steps, 1)}), flush=True)
        continue
    ps = prompts[cmd["category"]]
    batch = ps if cmd["batch"] == 8 else [ps[cmd["prompt"]]]
    m = generate(target, batch, sp, specs[cmd["method"]], chat=True).metrics
    keys = ("decode_tokens_per_s", "tokens_per_s", "generated_tokens", "compile_s", "ttft_s", "verify_steps",
            "draft_s", "verify_s", "sample_s")
    print(json.dumps({k: m[k] for k in keys if k in m}), flush=True)
"""


class Worker:
    def __init__(self, tree: str, conf: list):
        env = {**os.environ, "PYTHONPATH": tree}
        self.p = subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(conf)], cwd=tree, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self.file = json.loads(self.p.stdout.readline())["ready"]

    def __call__(self, cmd: dict) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--pair", choices=list(PAIRS), default="smollm2")
    ap.add_argument("--categories", nargs="+", default=["code", "chat"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tiny-repeats", type=int, default=40)
    ap.add_argument("--methods", nargs="+", default=["ar", "sd", "ssd"], help="sd_prof: SD stage by stage")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t, d, k_sd, (k_ssd, m_ssd), dtype = PAIRS[a.pair]
    conf = [t, d, k_sd, k_ssd, m_ssd, dtype, a.new_tokens]
    workers = {"before": Worker(a.before, conf), "after": Worker(a.after, conf)}
    rng = random.Random(0)
    calls = []
    units = [(c, b, i) for c in a.categories for b in a.batches for i in (range(8) if b == 1 else [0])]
    for w in workers.values():  # compile every shape once, untimed
        for c, b, i in {(c, b, 0) for c, b, _ in units}:
            for m in a.methods:
                w({"method": m, "category": c, "batch": b, "prompt": i})
    for rep in range(a.repeats):
        for c, b, i in units:
            for m in a.methods:
                order = rng.sample(list(workers), 2)
                for v in order:
                    r = workers[v]({"method": m, "category": c, "batch": b, "prompt": i})
                    calls.append({"version": v, "method": m, "category": c, "batch": b, "prompt": i, "repeat": rep,
                                  "load": os.getloadavg()[0], **r})  # fmt: skip
        print(f"repeat {rep + 1}/{a.repeats} done", file=sys.stderr, flush=True)
        _dump(a, conf, workers, calls)  # each repeat on disk, so a stopped run keeps what it measured
    for rep in range(a.tiny_repeats):
        for m in ("tiny_ar", "tiny_sd"):
            for v in rng.sample(list(workers), 2):
                calls.append({"version": v, "method": m, "repeat": rep, **workers[v]({"method": m})})
    _dump(a, conf, workers, calls)


def _dump(a, conf, workers, calls) -> None:
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(
            {"pair": a.pair, "conf": conf, "trees": {k: w.file for k, w in workers.items()}, "calls": calls},
            f,
        )
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
