"""Whole-model cost of decode, a K+1 = 5 token verify and a 64-token prefill, checkpoint forms
against the CPU forms (``ssd_jax.models.forms``), interleaved in one process.

    python experiments/probes/matmul_forms_model.py --model smollm2-135m-instruct      # real weights
    python experiments/probes/matmul_forms_model.py --shape qwen-0.5b                   # random weights, Qwen shapes

One copy of the weights is held: between blocks the parameters are transposed in place, one
tensor at a time (``params.to_layout``), so the 1.5B shape fits too. Each block times every
call ``--reps`` times; blocks alternate checkpoint / CPU forms ``--rounds`` times, and the
median over all of a form's calls is reported with the load average before and after.
Appends one JSON line per run to ``experiments/results/matmul_forms_model.jsonl``.
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

SHAPES = {  # hidden, ffn, layers, heads, kv heads, head dim, vocab, tied, qkv bias
    "qwen-0.5b": (896, 4864, 24, 14, 2, 64, 151936, True, True),
    "qwen-1.5b": (1536, 8960, 28, 12, 2, 128, 151936, False, True),
}


def _random_model(shape: str):
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models.config import ModelConfig
    from ssd_jax.models.params import param_specs, unflatten

    d, f, n, h, kv, hd, v, tie, bias = SHAPES[shape]
    cfg = ModelConfig(
        arch="qwen2",
        vocab_size=v,
        hidden_size=d,
        intermediate_size=f,
        num_layers=n,
        num_heads=h,
        num_kv_heads=kv,
        head_dim=hd,
        qkv_bias=bias,
        tie_embeddings=tie,
        rope_theta=1e6,
    )
    rng = np.random.default_rng(0)
    flat = {}
    for name, (s, _) in param_specs(cfg).items():
        a = rng.standard_normal(s, dtype=np.float32)
        a *= 1.0 if name.endswith("norm") else 0.02
        flat[name] = jnp.asarray(a)
        del a
    return cfg, unflatten(cfg, flat)


def candidates(cfg, names):
    """Named Forms to compare: checkpoint (today), cpu (the installed table), issue (issue 13's
    reading of the shared benchmark), io (everything stored (in, out), activations first)."""
    import jax

    from ssd_jax.models import forms as F

    io, io_left = F.Form("io"), F.Form("io", ("right", "left", "left"))
    known = {
        "checkpoint": F.CANONICAL,
        "cpu": F.for_backend(cfg, jax.default_backend()),
        "issue": F.Forms(q=io, o=io, gate=io, up=io, head=io, k=io_left, v=io_left, down=io_left),
        "io": F.Forms(**{r: io for r in F.ROLES}),
    }
    return {n: known[n] if n in known else parse_forms(n) for n in names}


def parse_forms(spec: str):
    """``"head=io"`` or ``"gate+up=io/k+v+down=io:right,left,left"``: the listed roles set, the rest checkpoint."""
    from ssd_jax.models import forms as F

    picked = {}
    for part in spec.split("/"):
        roles, form = part.split("=")
        layout, _, orders = form.partition(":")
        f = F.Form(layout, tuple(orders.split(",")) if orders else ("right",) * 3)
        picked.update({r: f for r in roles.split("+")})
    return F.Forms(**picked)


def relayout(cfg, params, forms):
    """Params in ``forms``' layout, one tensor at a time (the old one is freed before the next)."""
    from ssd_jax.models.params import flatten, to_layout, unflatten

    dst = cfg.replace(forms=forms)
    flat = flatten(params)
    del params
    for n in list(flat):
        new = to_layout(cfg, dst, n, flat[n])
        if new is not flat[n]:
            new.block_until_ready()
            flat[n].delete()
        flat[n] = new
    return dst, unflatten(dst, flat)


def laid_out(cfg, params, forms):
    """Params in ``forms``' layout, sharing every tensor whose layout does not change."""
    from ssd_jax.models.params import flatten, to_layout, unflatten

    dst = cfg.replace(forms=forms)
    return dst, unflatten(dst, {n: to_layout(cfg, dst, n, w) for n, w in flatten(params).items()})


def summarize(row: dict) -> str:
    """Markdown table of one run: medians over all calls, and ratios to decode taken within each
    block (same load) and then the median over blocks."""
    import numpy as np

    reps, loads = row["reps"], row["loadavg"]
    calls = list(next(iter(row["times_s"].values())))
    dec, ver, pre = calls
    lines = [
        f"**{row['model']}** ({row['date']}, {row['rounds']} blocks x {reps} calls per form, "
        f"load {loads[0][0]:.2f} -> {loads[-1][0]:.2f}, max {max(x[0] for x in loads):.2f})",
        "",
        f"| forms | {dec} ms | {ver} ms | {ver} / decode | {pre} ms | {pre} / decode | time / {{first}} |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {c: np.asarray(v).reshape(-1, reps) for c, v in next(iter(row["times_s"].values())).items()}
    first = next(iter(row["times_s"]))
    for lab, d in row["times_s"].items():
        blocks = {c: np.asarray(v).reshape(-1, reps) for c, v in d.items()}
        vs = {c: np.median(np.median(blocks[c], 1) / np.median(base[c], 1)) for c in calls}
        med = {c: np.median(b) for c, b in blocks.items()}
        mn = {c: np.min(b) for c, b in blocks.items()}
        ratio = {c: np.median(np.median(blocks[c], 1) / np.median(blocks[dec], 1)) for c in (ver, pre)}
        lines.append(
            f"| {lab} | {med[dec] * 1e3:.1f} ({mn[dec] * 1e3:.1f}) | {med[ver] * 1e3:.1f} ({mn[ver] * 1e3:.1f}) | "
            f"{ratio[ver]:.2f}x ({mn[ver] / mn[dec]:.2f}x) | {med[pre] * 1e3:.1f} ({mn[pre] * 1e3:.1f}) | "
            f"{ratio[pre]:.2f}x ({mn[pre] / mn[dec]:.2f}x) | "
            + " / ".join(f"{vs[c]:.2f}" for c in calls)
            + " |"
        )
    lines[2] = lines[2].replace("{first}", first)
    lines += [
        "",
        "Cells: median (min). Ratios: median over blocks of the in-block ratio (ratio of the minima); "
        f"last column: median over blocks of the block's time / {first}'s (decode / verify / prefill).",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a registry name or path (real weights)")
    ap.add_argument("--shape", choices=list(SHAPES), help="random weights of this shape instead")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument(
        "--interleave", action="store_true", help="hold every candidate at once and alternate per call"
    )
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--context", type=int, default=64, help="tokens already in the cache")
    ap.add_argument(
        "--forms",
        nargs="+",
        default=["checkpoint", "cpu"],
        help="checkpoint, cpu, issue, io, or a spec for parse_forms",
    )
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models import llama

    if a.model:
        from ssd_jax.loading import load_model

        m = load_model(a.model, forms="canonical")
        cfg, params, name = m.cfg, m.params, a.model
        del m
    else:
        cfg, params = _random_model(a.shape)
        name = f"random {a.shape}"
    cands = candidates(cfg, a.forms)
    max_len = a.context + a.prefill + a.k + 8

    def step(params, cfg, tokens, cache, last_only):
        h, _ = llama.forward(params, cfg, tokens, cache)
        return llama.logits(params, cfg, h[:, -1:] if last_only else h)

    run = jax.jit(step, static_argnums=(1, 4))
    rng = np.random.default_rng(0)
    calls = {
        "decode": (1, False, a.context),
        f"verify{a.k + 1}": (a.k + 1, False, a.context),
        f"prefill{a.prefill}": (a.prefill, True, 0),
    }
    inputs = {}
    for c, (t, _, ctx) in calls.items():
        cache = llama.init_cache(cfg, 1, max_len).with_lengths(jnp.full((1,), ctx, jnp.int32))
        inputs[c] = (jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32), cache)
    times = {lab: {c: [] for c in calls} for lab in cands}
    loads = [os.getloadavg()]
    if a.interleave:  # every candidate held at once (untransposed tensors shared); forms alternate per call
        held = {lab: laid_out(cfg, params, forms) for lab, forms in cands.items()}
        for fc, fp in held.values():
            for c, (_, last, _) in calls.items():
                run(fp, fc, *inputs[c], last).block_until_ready()  # compile / warm
        for i in range(a.reps):
            for c, (_, last, _) in calls.items():
                for lab, (fc, fp) in held.items():
                    t0 = time.perf_counter()
                    run(fp, fc, *inputs[c], last).block_until_ready()
                    times[lab][c].append(time.perf_counter() - t0)
            if i % 5 == 4:
                loads.append(os.getloadavg())
                print(f"rep {i + 1}/{a.reps}, load {loads[-1][0]:.2f}", file=sys.stderr, flush=True)
        a.rounds, a.reps = a.reps, 1  # blocks of one call: ratios are taken call by call
    for r in range(0 if a.interleave else a.rounds):
        for lab, forms in cands.items():
            cfg, params = relayout(cfg, params, forms)
            for c, (_, last, _) in calls.items():
                run(params, cfg, *inputs[c], last).block_until_ready()  # compile / warm
            for _ in range(a.reps):
                for c, (_, last, _) in calls.items():
                    t0 = time.perf_counter()
                    run(params, cfg, *inputs[c], last).block_until_ready()
                    times[lab][c].append(time.perf_counter() - t0)
            loads.append(os.getloadavg())
            print(
                f"round {r} {lab}: "
                + ", ".join(f"{c} {np.median(v) * 1e3:.1f} ms" for c, v in times[lab].items()),
                file=sys.stderr,
                flush=True,
            )
    med = {lab: {c: float(np.median(v)) for c, v in d.items()} for lab, d in times.items()}
    row = {
        "model": name,
        "forms": {n: f.to_dict() for n, f in cands.items()},
        "reps": a.reps,
        "rounds": a.rounds,
        "median_s": med,
        "times_s": times,
        "loadavg": loads,
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = ROOT / "experiments" / "results" / "matmul_forms_model.jsonl"
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(summarize(row))


if __name__ == "__main__":
    main()
