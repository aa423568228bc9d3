"""Whole-model cost of the attention core: the CPU attention kernel (``kernels.attention``) against
XLA's einsums, on the real Qwen pair, interleaved call by call in one process.

    python experiments/probes/attention_kernel.py --reps 15

Rows: the Qwen2.5-Coder-1.5B target's forward + logits over T = 1 (a decode step) and T = 9 (a
K = 8 verify), and one step of the 0.5B draft as the engine runs it with ``--draft-vocab 32768
--draft-dtype bfloat16`` (forward + trimmed head + argmax); cache of 512 slots, 250 in use.
Medians over ``--reps``; appends one JSON line to ``experiments/results/attention_cpu.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from ssd_jax.drafters.vocab import load_with_head, trimmed_draft
    from ssd_jax.loading import load_model
    from ssd_jax.loading.loaded import with_weight_dtype
    from ssd_jax.models import kernels, llama
    from ssd_jax.parallel.placement import cache_for

    assert kernels.available(), "the kernels did not build"
    target = load_model("qwen2.5-coder-1.5b-instruct")
    draft = trimmed_draft(
        with_weight_dtype(load_with_head("qwen2.5-coder-0.5b-instruct", dtype="float32"), "bfloat16"),
        32768,
        None,
    )
    B, L, used = a.batch, 512, 250
    cases = {  # name: (model, T, argmax)
        "target T=1 (decode)": (target, 1, False),
        "target T=9 (verify, K=8)": (target, 9, False),
        "draft step (bf16, 32768-token head)": (draft, 1, True),
    }
    routed = kernels.attention_usable
    fns, args = {}, {}
    for name, (m, T, arg) in cases.items():
        for impl in ("kernel", "einsum"):
            kernels.attention_usable = routed if impl == "kernel" else (lambda *x: False)

            def f(p, c, tk, m=m, arg=arg):
                lg = llama.logits(p, m.cfg, llama.forward(p, m.cfg, tk, c)[0])
                return jnp.argmax(lg, -1) if arg else lg

            fns[(name, impl)] = jax.jit(f)
            args[(name, impl)] = (
                m.params,
                cache_for(m, B, L).with_lengths(jnp.full((B,), used, jnp.int32)),
                jnp.full((B, T), 100, jnp.int32),
            )
            jax.block_until_ready(fns[(name, impl)](*args[(name, impl)]))  # traced under this routing
    kernels.attention_usable = routed
    times = {key: [] for key in fns}
    load0 = os.getloadavg()[0]
    for _ in range(a.reps):
        for key, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args[key]))
            times[key].append(time.perf_counter() - t0)
    rows = []
    for name in cases:
        k_ms, e_ms = (statistics.median(times[(name, i)]) * 1e3 for i in ("kernel", "einsum"))
        rows.append({"case": name, "kernel_ms": k_ms, "einsum_ms": e_ms})
        print(f"{name}: kernel {k_ms:.1f} ms, einsums {e_ms:.1f} ms, ratio {k_ms / e_ms:.3f}", flush=True)
    rec = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "jax": jax.__version__,
        "batch": B,
        "cache_slots": L,
        "used": used,
        "reps": a.reps,
        "load": [load0, os.getloadavg()[0]],
        "rows": rows,
    }
    with open(ROOT / "experiments" / "results" / "attention_cpu.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
