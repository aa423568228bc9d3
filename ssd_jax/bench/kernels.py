"""The CPU kernels against XLA, build by build (issue 54): ``python -m ssd_jax.bench.kernels``.

Three parts, each writing its rows to ``<out>/kernels_cpu_<tag>.json`` with a markdown table beside it:

* ``matmul``: ``y = x W^T`` at M = 1..16 rows (``--rows``) on the default models' matrix shapes, every
  build this machine can run (``native``, ``avx2`` where the CPU has it: on an AVX-512 machine it
  reproduces an AVX2-only one, ``portable``) and XLA's dot, all in one process, interleaved call by
  call; the weights are copies of the matrix adding up to about 300 MB, so they stream from memory
  as in a model. Each cell: the median over ``--reps`` and its 95% interval (t over the repeats).
* ``attention``: the attention kernel of each build against XLA's einsum reference at T = 1..16 new
  tokens over a context of ``--context`` slots, at each model's head layout (batch 1).
* ``forward``: each model's whole forward plus its output head at T = 1..16 new tokens (a T-token
  verify; T = 1 is the decode step) over ``--context`` cached tokens, one child process per build
  (``SSD_JAX_KERNEL_ISA``) plus one with the kernels off (XLA alone) per instruction set, on 1 core and
  on 2 (``--cores``), the T values interleaved within the child. The avx2 children also limit XLA's own
  code generation to AVX2 (``--xla_cpu_max_isa=AVX2``), so the pair reproduces an AVX2-only machine.
  The matmul forms are those the loader picks on this machine (measured, ``ssd_jax.models.form_timing``).

The load average is recorded before and after each part; the machine's CPU model and instruction set
flags and the git commit go into the file. Speed is only measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: d, f, vocab, q out, kv out, kv heads, head dim (the default target of each pair)
MODELS = {
    "smollm2-135m-instruct": (576, 1536, 49152, 576, 192, 3, 64),
    "qwen2.5-coder-1.5b-instruct": (1536, 8960, 151936, 1536, 256, 2, 128),
}
LAYERS = {"smollm2-135m-instruct": 30, "qwen2.5-coder-1.5b-instruct": 28}
#: products per layer of each matrix role (q and o, k and v, gate and up, down); the head once per forward
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
TOTAL_BYTES = 300e6


def matrix_shapes(model: str) -> dict[str, tuple[int, int]]:
    d, f, v, q, kv, _, _ = MODELS[model]
    return {"q/o": (q, d), "k/v": (kv, d), "gate/up": (f, d), "down": (d, f), "lm_head": (v, d)}


def _cell(xs: list[float]) -> dict:
    from ssd_jax.bench.stats import mean_ci

    xs = sorted(xs)
    mean, lo, hi = mean_ci(xs)
    return {"median_s": xs[len(xs) // 2], "mean_s": mean, "ci95_s": [lo, hi], "n": len(xs)}


def _interleaved(fns: dict, args: dict, reps: int) -> dict:
    """fns: name -> jitted f; args: name -> tuple; per name the seconds of each repeat (after a warm call)."""
    import jax

    for name, f in fns.items():
        jax.block_until_ready(f(*args[name]))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*args[name]))
            times[name].append(time.perf_counter() - t)
    return times


def part_matmul(models, builds, rows, reps) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models import kernels

    impls = {"xla": lambda x, w: jnp.einsum("mi,oi->mo", x, w, preferred_element_type=jnp.float32)}
    for b in builds:
        impls[b] = kernels.variant(b).rows_matmul
    out = []
    rng = np.random.default_rng(0)
    for model in models:
        for role, (n, k) in matrix_shapes(model).items():
            L = int(max(1, min(64, TOTAL_BYTES // (n * k * 4))))
            ws = [jnp.asarray(rng.standard_normal((n, k), dtype=np.float32)) for _ in range(L)]
            fns, args = {}, {}
            for m in rows:
                x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
                for name, mm in impls.items():
                    fns[(name, m)] = jax.jit(lambda x, ws, mm=mm: [mm(x, w) for w in ws])
                    args[(name, m)] = (x, ws)
            load = [os.getloadavg()[0]]
            times = _interleaved(fns, args, reps)
            load.append(os.getloadavg()[0])
            cells = {f"{name} M={m}": _cell([t / L for t in v]) for (name, m), v in times.items()}
            out.append(
                {"part": "matmul", "model": model, "role": role, "shape": [n, k], "copies": L, "load": load}
                | {"cells": cells}
            )
            one = {name: cells[f"{name} M=1"]["median_s"] for name in impls}
            print(
                f"matmul {model} {role} {n}x{k}: "
                + "  ".join(
                    f"{name} M=1 {one[name] * 1e3:.3f} ms, M=5 x{cells[f'{name} M=5']['median_s'] / one[name]:.2f}"
                    for name in impls
                    if 5 in rows
                ),
                flush=True,
            )
            del ws
    return out


def part_attention(models, builds, ts, reps, context) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models import kernels

    impls = {"xla": lambda q, k, v, mask: kernels.attention_reference(q, k, v, mask, 0.125)}
    for b in builds:
        impls[b] = functools.partial(kernels.variant(b).attention, scale=0.125)
    rng = np.random.default_rng(0)
    out = []
    for model in models:
        *_, kvh, hd = MODELS[model]
        g = MODELS[model][3] // hd // kvh
        k = jnp.asarray(rng.standard_normal((1, context, kvh, hd), dtype=np.float32))
        v = jnp.asarray(rng.standard_normal((1, context, kvh, hd), dtype=np.float32))
        fns, args = {}, {}
        for t in ts:
            q = jnp.asarray(rng.standard_normal((1, t, kvh, g, hd), dtype=np.float32))
            slots = context - t + np.arange(t)
            mask = jnp.asarray(np.arange(context)[None, None, :] <= slots[None, :, None])
            for name, f in impls.items():
                fns[(name, t)] = jax.jit(f)
                args[(name, t)] = (q, k, v, mask)
        load = [os.getloadavg()[0]]
        times = _interleaved(fns, args, reps)
        load.append(os.getloadavg()[0])
        cells = {f"{name} T={t}": _cell(v) for (name, t), v in times.items()}
        out.append({"part": "attention", "model": model, "context": context, "load": load, "cells": cells})
        print(
            f"attention {model} S={context}: "
            + "  ".join(
                f"{name} T=1 {cells[f'{name} T=1']['median_s'] * 1e6:.0f} us T=16 "
                f"{cells[f'{name} T={ts[-1]}']['median_s'] * 1e6:.0f} us"
                for name in impls
            ),
            flush=True,
        )
    return out


def child_forward(model: str, ts: list[int], reps: int, context: int) -> dict:
    """In a child process (its build and cores set by the parent): the forward + head at each T."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import ssd_jax
    from ssd_jax.models import form_timing, kernels, llama

    m = ssd_jax.load_model(model)
    cfg = m.cfg
    fwd = jax.jit(
        lambda p, t, c: llama.logits(p, cfg, llama.forward(p, cfg, t, c)[0]),
    )
    cache = llama.init_cache(cfg, 1, context + 32)
    cache = cache.with_lengths(jnp.full((1,), context - 16, jnp.int32))
    fns, args = {}, {}
    for t in ts:
        toks = jnp.asarray(np.arange(t)[None, :] % cfg.vocab_size, jnp.int32)
        fns[t] = fwd
        args[t] = (m.params, toks, cache)
    times = _interleaved(fns, args, reps)
    return {
        "kernels": kernels.isa(),
        "forms": form_timing.describe(cfg.forms),
        "cells": {f"T={t}": _cell(v) for t, v in times.items()},
    }


def _forward_runs(builds) -> list[str]:
    """The forward part's children: each build, then XLA alone (kernels off) after each instruction set
    (``xla`` native, ``xla-avx2`` with XLA's code generation limited to AVX2 as on such a machine)."""
    out = []
    for b in builds:
        out += [b, "xla" if b == "native" else f"xla-{b}"]
    return out


def part_forward(models, builds, ts, reps, context, core_sets) -> list[dict]:
    """One child process per (model, cores, build), the builds in turn; each child times every T ``reps``
    times, the T values interleaved (the child's compile and load are not timed)."""
    out = []
    for model in models:
        for cores in core_sets:
            for b in _forward_runs(builds):
                env = dict(os.environ, SSD_JAX_KERNEL_ISA=b.removeprefix("xla-") if b != "xla" else "native")
                if b.startswith("xla"):
                    env["SSD_JAX_KERNELS"] = "off"
                if b.endswith(
                    "avx2"
                ):  # XLA's own code generation limited to AVX2 too: the whole AVX2 machine
                    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_cpu_max_isa=AVX2".strip()
                cmd = [
                    sys.executable, "-m", "ssd_jax.bench.kernels", "--child-forward", model,
                    "--ts", *map(str, ts), "--reps", str(reps), "--context", str(context),
                    "--cores", ",".join(map(str, cores)),
                ]  # fmt: skip
                load = [os.getloadavg()[0]]
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"forward child {b} failed: {r.stderr.strip().splitlines()[-1:]}")
                res = json.loads(r.stdout.strip().splitlines()[-1])
                load.append(os.getloadavg()[0])
                row = {
                    "part": "forward", "model": model, "build": b, "cores": len(cores),
                    "kernels": res["kernels"], "forms": res["forms"], "load": load, "cells": res["cells"],
                }  # fmt: skip
                out.append(row)
                one = res["cells"]["T=1"]["median_s"]
                print(
                    f"forward {model} {b} {len(cores)} core(s): T=1 {one * 1e3:.1f} ms, "
                    + ", ".join(
                        f"T={t} x{res['cells'][f'T={t}']['median_s'] / one:.2f}"
                        for t in ts
                        if t in (2, 5, 8, 16)
                    ),
                    flush=True,
                )
    return out


def _env() -> dict:
    from ssd_jax.bench.common import environment
    from ssd_jax.compile import cpu_tag
    from ssd_jax.models import kernels

    flags = kernels.cpu_flags()
    tag = cpu_tag().splitlines()
    return environment() | {
        "cpu_model": next((ln.split(":", 1)[1].strip() for ln in tag if ln.startswith("model name")), ""),
        "isa_flags": sorted(f for f in flags if f.startswith(("avx", "fma", "sse4", "asimd", "sve"))),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def predicted_forward(rows: list[dict], model: str, impl: str, t: int) -> float | None:
    """The forward at T new tokens (batch 1) predicted from the parts measured alone: per layer its
    products at M = T rows and its attention at T, times the layers, plus the head; None where a part is
    missing. Everything else in a forward (norms, RoPE, the cache write, the embedding) is left out, so
    the prediction's ratio to T = 1 assumes those cost nothing."""
    mm = {r["role"]: r["cells"] for r in rows if r["part"] == "matmul" and r["model"] == model}
    at = next((r["cells"] for r in rows if r["part"] == "attention" and r["model"] == model), None)
    try:
        layer = sum(n * mm[role][f"{impl} M={t}"]["median_s"] for role, n in PER_LAYER.items())
        layer += at[f"{impl} T={t}"]["median_s"] if at else 0.0
        return LAYERS[model] * layer + mm["lm_head"][f"{impl} M={t}"]["median_s"]
    except (KeyError, TypeError):
        return None


def _axes(cells: dict, axis: str) -> tuple[list[str], list[int]]:
    """A part's implementations (XLA first) and its values of ``axis`` ("M" or "T"), read from its cell names
    (``"<impl> M=5"``)."""
    impls = sorted({k.split(f" {axis}=")[0] for k in cells}, key=lambda s: (s != "xla", s))
    return impls, sorted({int(k.split(f"{axis}=")[1]) for k in cells})


def _render_matmul(res: dict) -> list[str]:
    """The matmul table."""
    lines: list[str] = []
    mm = [r for r in res["rows"] if r["part"] == "matmul"]
    if mm:
        impls, rows = _axes(mm[0]["cells"], "M")
        show = [m for m in rows if m in (1, 2, 5, 8, 16)]
        lines += ["## Matmul, one call (ms; x = / M=1)", ""]
        lines.append("| model | W (out x in) | impl | " + " | ".join(f"M={m}" for m in show) + " | load |")
        lines.append("|---|---|---|" + "---|" * len(show) + "---|")
        for r in mm:
            for i in impls:
                one = r["cells"][f"{i} M=1"]["median_s"]
                cells = [
                    f"{r['cells'][f'{i} M={m}']['median_s'] * 1e3:.3f}"
                    + ("" if m == 1 else f" (x{r['cells'][f'{i} M={m}']['median_s'] / one:.2f})")
                    for m in show
                ]
                lines.append(
                    f"| {r['model'].split('-instruct')[0]} | {r['shape'][0]} x {r['shape'][1]} | {i} | "
                    + " | ".join(cells)
                    + f" | {r['load'][0]:.2f} |"
                )
        lines.append("")
    return lines


def _render_attention(res: dict) -> list[str]:
    """The attention table."""
    lines: list[str] = []
    at = [r for r in res["rows"] if r["part"] == "attention"]
    if at:
        impls, ts = _axes(at[0]["cells"], "T")
        show = [t for t in ts if t in (1, 2, 4, 5, 8, 16)]
        lines += ["## Attention of T new tokens over the context (us)", ""]
        lines.append("| model | context | impl | " + " | ".join(f"T={t}" for t in show) + " |")
        lines.append("|---|---|---|" + "---|" * len(show))
        for r in at:
            for i in impls:
                lines.append(
                    f"| {r['model'].split('-instruct')[0]} | {r['context']} | {i} | "
                    + " | ".join(f"{r['cells'][f'{i} T={t}']['median_s'] * 1e6:.0f}" for t in show)
                    + " |"
                )
        lines.append("")
    return lines


def _render_forward(res: dict) -> list[str]:
    """The forward table, with the prediction from the parts."""
    lines: list[str] = []
    fw = [r for r in res["rows"] if r["part"] == "forward"]
    if fw:
        _, ts = _axes(fw[0]["cells"], "T")
        show = [t for t in ts if t in (1, 2, 5, 8, 16)]
        lines += [
            "## Whole forward + head at T new tokens (ms; x = / T=1: a T-token verify against the decode step)",
            "",
        ]
        lines.append(
            "| model | cores | build | "
            + " | ".join(f"T={t}" for t in show)
            + " | predicted T=5 / T=1 | forms | load |"
        )
        lines.append("|---|---|---|" + "---|" * len(show) + "---|---|---|")
        for r in fw:
            one = r["cells"]["T=1"]
            cells = []
            for t in show:
                c = r["cells"][f"T={t}"]
                lo, hi = c["ci95_s"]
                s = f"{c['median_s'] * 1e3:.1f}"
                if t > 1:
                    s += f" (x{c['median_s'] / one['median_s']:.2f})"
                elif lo == lo:  # not nan
                    s += f" [{lo * 1e3:.1f}, {hi * 1e3:.1f}]"
                cells.append(s)
            impl = r["build"].split("-")[0]  # the matmul / attention parts: xla-avx2 -> xla
            p1, p5 = (predicted_forward(res["rows"], r["model"], impl, t) for t in (1, 5))
            pred = f"x{p5 / p1:.2f} ({p1 * 1e3:.1f} ms at T=1)" if p1 and p5 and r["cores"] == 2 else "-"
            lines.append(
                f"| {r['model'].split('-instruct')[0]} | {r['cores']} | {r['build']} | "
                + " | ".join(cells)
                + f" | {pred} | {r['forms']} | {min(r['load']):.2f}-{max(r['load']):.2f} |"
            )
        lines.append("")
    return lines


def render(res: dict) -> str:
    env = res["env"]
    lines = [
        f"# CPU kernels against XLA ({env['date']}, commit {env['git_commit']})",
        "",
        f"CPU: {env['cpu_model']}; AVX-512: {'avx512f' in env['isa_flags']}; flags: {' '.join(env['isa_flags'])}. "
        f"Builds: {', '.join(f'{b} = {s}' for b, s in res['builds'].items())}. Cells are medians (ms); "
        "ratios are to the same implementation's M = 1 / T = 1.",
        "",
    ]
    lines += _render_matmul(res) + _render_attention(res) + _render_forward(res)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["matmul", "attention", "forward"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--builds", nargs="+", help="kernel builds (default: every one this machine can run)")
    ap.add_argument("--rows", type=int, nargs="+", default=list(range(1, 17)))
    ap.add_argument("--ts", type=int, nargs="+", default=list(range(1, 17)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--cores", default="1,2", help="forward: the core counts to run on, e.g. 1,2")
    ap.add_argument("--out", default="experiments/results")
    ap.add_argument("--tag", default="", help="a suffix for the results file")
    ap.add_argument("--render", metavar="JSON", help="only re-render a results file's markdown table")
    ap.add_argument("--child-forward", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.child_forward:  # pin first: XLA sizes its thread pool by the cores it may use
        os.sched_setaffinity(0, {int(c) for c in a.cores.split(",")})
        print(json.dumps(child_forward(a.child_forward, a.ts, a.reps, a.context)))
        return 0

    if a.render:
        res = json.loads(Path(a.render).read_text())
        Path(a.render).with_suffix(".md").write_text(render(res) + "\n")
        return 0

    from ssd_jax.models import kernels

    builds = a.builds or list(kernels.runnable_isas())
    res = {"env": _env(), "builds": {b: kernels.variant(b).said for b in builds}, "args": vars(a), "rows": []}
    for m in a.models:
        if m not in MODELS:
            raise SystemExit(f"error: unknown model {m!r} (known: {', '.join(MODELS)})")
    if "matmul" in a.parts:
        res["rows"] += part_matmul(a.models, builds, sorted(set(a.rows) | {1}), a.reps)
    if "attention" in a.parts:
        res["rows"] += part_attention(a.models, builds, sorted(set(a.ts) | {1}), a.reps, a.context)
    if "forward" in a.parts:
        ncores = [int(c) for c in a.cores.split(",")]
        core_sets = [list(range(n)) for n in ncores]
        res["rows"] += part_forward(a.models, [b for b in builds if b != "portable"], sorted(set(a.ts) | {1}),
                                    a.reps, a.context, core_sets)  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "kernels_cpu" + (f"_{a.tag}" if a.tag else "")
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out / f"{name}.md").write_text(render(res) + "\n")
    print(f"wrote {out / name}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
