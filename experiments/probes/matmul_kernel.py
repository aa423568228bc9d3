"""Per matrix: XLA's ``x @ W.T`` against the project's CPU kernel (``ssd_jax.models.kernels``) at
M = 1 and M = 5 rows, on the SmolLM2-135M, Qwen2.5-0.5B and Qwen2.5-1.5B shapes (float32).

    python experiments/probes/matmul_kernel.py --models smollm2-135m qwen-0.5b --reps 7

``--weight-dtypes float32 bfloat16`` also times W stored in bfloat16 under float32 rows (a
``--draft-dtype bfloat16`` draft): XLA's mixed dot ``xla-bf16`` against the kernel's bfloat16
path ``kernel-bf16``, interleaved with the float32 pair (``experiments/results/draft_bf16_cpu.md``).

``--baseline REV`` also builds the kernel sources of git revision REV (same compiler and flags)
and interleaves them as ``base`` / ``base-bf16``: an A/B of a kernel change in one process
(``experiments/results/kernel_reduction_cpu.md``).

As in ``tools/matmul_forms.py``: L distinct copies of the matrix (about 300 MB in all,
so the weights stream from memory, not from the 260 MB L3 of this VM) are applied in one
jitted call and the time is divided by L. The two implementations and both row counts
alternate call by call (interleaved); cells are medians over ``--reps``. Appends one JSON line
per run to ``experiments/results/matmul_kernel_cpu.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's ssd_jax, not an installed one

MODELS = {  # d, f, v, q out, kv out
    "smollm2-135m": (576, 1536, 49152, 576, 192),
    "qwen-0.5b": (896, 4864, 151936, 896, 128),
    "qwen-1.5b": (1536, 8960, 151936, 1536, 256),
}
TOTAL_BYTES = 300e6


def shapes(model: str) -> dict[str, tuple[int, int]]:
    d, f, v, q, kv = MODELS[model]
    return {"q/o": (q, d), "k/v": (kv, d), "gate/up": (f, d), "down": (d, f), "lm_head": (v, d)}


def baseline_kernel(rev: str):
    """``x @ w.T`` by the kernel sources of git revision ``rev``, built to a temporary folder with
    the project's flags and registered under their own FFI names (``<target>_baseline``)."""
    import ctypes
    import subprocess
    import tempfile

    import jax
    import jax.numpy as jnp

    from ssd_jax.models import kernels

    tmp = Path(tempfile.mkdtemp(prefix="kernel_baseline_"))
    for f in (*kernels.SOURCES, *kernels.HEADERS):
        rel = f.relative_to(ROOT).as_posix()
        src = subprocess.run(
            ["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        (tmp / f.name).write_text(src.stdout)
    lib = tmp / "libbaseline.so"
    cmd = [
        kernels.compiler(),
        *kernels.ISAS[kernels.isa_wanted()][0],
        *kernels.BASE_FLAGS,
        f"-I{jax.ffi.include_dir()}",
        f"-I{tmp}",
        *(str(tmp / f.name) for f in kernels.SOURCES),
        "-o",
        str(lib),
    ]
    subprocess.run(cmd, check=True)
    handle = ctypes.CDLL(str(lib))
    for target, symbol in ((kernels.TARGET, kernels.SYMBOL), (kernels.TARGET_BF16, kernels.SYMBOL_BF16)):
        jax.ffi.register_ffi_target(
            f"{target}_baseline", jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu"
        )

    def mm(x, w):
        target = kernels.TARGET_BF16 if w.dtype == jnp.bfloat16 else kernels.TARGET
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
        return jax.ffi.ffi_call(f"{target}_baseline", out, vmap_method="sequential")(x, w)

    return mm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--rows", type=int, nargs="+", default=[1, 5], help="row counts (1 and 5 give the ratios)"
    )
    ap.add_argument("--roles", nargs="+", help="only these roles (q/o, k/v, gate/up, down, lm_head)")
    ap.add_argument(
        "--head-rows", type=int, default=None, help="lm_head rows (e.g. 32768: a trimmed draft head)"
    )
    ap.add_argument(
        "--weight-dtypes",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="dtypes W is stored in (x and y stay float32)",
    )
    ap.add_argument("--baseline", metavar="REV", help="also time the kernel sources of this git revision")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models import kernels

    assert kernels.available(), "the kernel did not build"

    def xla(x, w):
        return jnp.einsum("mi,oi->mo", x, w, preferred_element_type=jnp.float32)

    base = baseline_kernel(a.baseline) if a.baseline else None
    impls = {}
    for dt in a.weight_dtypes:
        sfx = "" if a.weight_dtypes == ["float32"] else "-" + {"float32": "f32", "bfloat16": "bf16"}[dt]
        impls[f"xla{sfx}"] = (dt, xla)
        impls[f"kernel{sfx}"] = (dt, kernels.rows_matmul)
        if base is not None:
            impls[f"base{sfx}"] = (dt, base)
    rows = tuple(a.rows)
    rng = np.random.default_rng(0)
    out = []
    for model in a.models:
        for role, (n, k) in shapes(model).items():
            if a.roles and role not in a.roles:
                continue
            if role == "lm_head" and a.head_rows:
                n = a.head_rows
            # per dtype, L copies of about TOTAL_BYTES in all: the weights stream from memory
            size = {dt: jnp.dtype(dt).itemsize for dt in a.weight_dtypes}
            L = {
                dt: int(max(1, min(256 * 4 // size[dt], TOTAL_BYTES // (n * k * size[dt]))))
                for dt in a.weight_dtypes
            }
            wsets = {
                dt: [
                    jnp.asarray(rng.standard_normal((n, k), dtype=np.float32)).astype(dt)
                    for _ in range(L[dt])
                ]
                for dt in a.weight_dtypes
            }
            xs = {m: jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)) for m in rows}
            fns = {}
            for name, (dt, mm) in impls.items():

                def run(x, ws, mm=mm):  # separate outputs: a sum would let XLA fuse its M = 1 dots badly
                    return [mm(x, w) for w in ws]

                fns[name] = (dt, jax.jit(run))
            for dt, f in fns.values():
                for x in xs.values():
                    jax.block_until_ready(f(x, wsets[dt]))
            t = {(name, m): [] for name in fns for m in rows}
            load0 = os.getloadavg()[0]
            for _ in range(a.reps):
                for m, x in xs.items():
                    for name, (dt, f) in fns.items():
                        t0 = time.perf_counter()
                        jax.block_until_ready(f(x, wsets[dt]))
                        t[(name, m)].append((time.perf_counter() - t0) / L[dt])
            med = {f"{name} M={m}": float(np.median(v)) for (name, m), v in t.items()}
            row = {
                "model": model,
                "role": role,
                "shape": [n, k],
                "copies": L,
                "median_s": med,
                "load": [load0, os.getloadavg()[0]],
                "weight_dtypes": a.weight_dtypes,
            }
            out.append(row)
            ratios = ""
            if {1, 5} <= set(rows) and "xla M=1" in med:
                e1 = med["xla M=1"]
                ratios = (
                    f" | xla5/xla1 {med['xla M=5'] / e1:.2f}  kernel5/xla1 {med['kernel M=5'] / e1:.2f}"
                    f"  kernel5/kernel1 {med['kernel M=5'] / med['kernel M=1']:.2f}"
                    f"  kernel1/xla1 {med['kernel M=1'] / e1:.2f}"
                )
            print(
                f"{model} {role} {n}x{k} (L={L}, load {load0:.2f}->{row['load'][1]:.2f}): "
                + "  ".join(f"{c} {v * 1e3:.3f} ms" for c, v in med.items())
                + ratios,
                flush=True,
            )
            del wsets
    rec = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "jax": jax.__version__,
        "reps": a.reps,
        "row_counts": list(rows),
        "rows": out,
        "baseline": a.baseline,
        "kernel_build": kernels.build_id(),
    }
    with open(ROOT / "experiments" / "results" / "matmul_kernel_cpu.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
