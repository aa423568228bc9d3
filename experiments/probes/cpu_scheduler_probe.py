"""Per-call page faults, kernel time and decode speed of AR and SD (bf16 trimmed Qwen-0.5B draft) in
one process; SSD_JAX_XLA_DEFAULTS=0 runs it with XLA:CPU's default scheduler. An anecdote probe
(1 prompt x 3 repeats), not a protocol result: see experiments/results/cpu_scheduler.md."""

import os
import sys
import time
import resource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ssd_jax
from ssd_jax.bench import protocol
from ssd_jax.decoding.batch import encode_prompts

t = ssd_jax.load_model("qwen2.5-coder-1.5b-instruct", dtype="float32")
d = ssd_jax.load_model("qwen2.5-coder-0.5b-instruct", dtype="float32")
ids = encode_prompts(t, [r["prompt"] for r in protocol.category_prompts("code", 1)], chat=True)
runners = {
    n: protocol.EngineRunner(t, s) for n, s in protocol.method_specs(["ar", "sd:auto:v32768:bf16"], d).items()
}
for r in runners.values():
    r([ids[0]], 32)
hold = None
if len(sys.argv) > 1:  # hold memory in another process while measuring
    import subprocess

    hold = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import numpy as np, time\nx=np.ones(int({sys.argv[1]}*2**30)//8)\nprint('holding', flush=True)\ntime.sleep(3600)",
        ],
        stdout=subprocess.PIPE,
    )
    hold.stdout.readline()
    print("holding", sys.argv[1], "GiB;", open("/proc/meminfo").read().split("\n")[1], flush=True)
for _rep in range(3):
    for n, r in runners.items():
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        w = time.perf_counter()
        m = r([ids[0]], 32)
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        w = time.perf_counter() - w
        print(
            f"{n:22s} dec {m['decode_tok_s']:.2f} tok/s wall {w:.2f} s minflt {u1.ru_minflt - u0.ru_minflt:7d} majflt {u1.ru_majflt - u0.ru_majflt} "
            f"ttft {m['ttft_s']:.2f} sys {u1.ru_stime - u0.ru_stime:.2f} user {u1.ru_utime - u0.ru_utime:.2f} rounds {m['rounds']}",
            flush=True,
        )
if hold:
    hold.kill()
