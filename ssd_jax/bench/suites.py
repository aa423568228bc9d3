"""The per-method benchmark suites ``ar``, ``sd`` and ``ssd`` (``python -m ssd_jax.bench --suite ...``).

Suite ``ar`` (the foundation benchmark): for each model, batch-1 greedy AR decode speed,
compile time and peak RSS, each model in its own subprocess (so peak RSS is its own), next
to the memory-bandwidth roofline: weight bytes read per token / measured read bandwidth.
The load average is recorded beside every number: these machines are shared.

Results go to ``experiments/results/<suite>_<backend>.json`` and a markdown table beside it
(:func:`render`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

from ssd_jax.bench.common import environment, load_draft

BENCH_PROMPT = "def quicksort(arr):\n    "
DEFAULT_MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")


def measure_bandwidth(gbytes: float = 1.0, repeats: int = 7) -> float:
    """Best read bandwidth (GB/s) over a few kernels streaming a large float32 array.

    The maximum over a full reduction and a matrix-vector product (the decode step's own
    access pattern) is used, so the roofline is the best this machine was seen to do, not a
    pessimistic one that would flatter the efficiency figure.
    """
    import jax
    import jax.numpy as jnp

    n = int(gbytes * 1e9 / 4) // 1024 * 1024
    x = jnp.ones((1024, n // 1024), jnp.float32)
    v = jnp.ones((1, n // 1024), jnp.float32)
    kernels = [
        (jax.jit(lambda a: jnp.sum(a)), (x,)),
        (jax.jit(lambda a, b: jnp.einsum("bi,oi->bo", b, a)), (x, v)),
    ]
    best = float("inf")
    for f, a in kernels:
        f(*a).block_until_ready()
        for _ in range(repeats):
            t = time.perf_counter()
            f(*a).block_until_ready()
            best = min(best, time.perf_counter() - t)
    del x
    return n * 4 / best / 1e9


def ar_one(model_name: str, new_tokens: int, dtype: str | None, repeats: int) -> dict:
    """Run in a child process: load, compile, decode; report speed and peak RSS."""
    import resource

    import ssd_jax
    from ssd_jax.models.params import count_params, weight_bytes_per_token

    t = time.perf_counter()
    model = ssd_jax.load_model(model_name, dtype=dtype)
    load_s = time.perf_counter() - t
    sp = ssd_jax.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    first = ssd_jax.generate(model, [BENCH_PROMPT], sp)  # includes compilation
    runs = [ssd_jax.generate(model, [BENCH_PROMPT], sp).metrics for _ in range(repeats)]
    best = min(runs, key=lambda m: m["tpot_s"])
    itemsize = 2 if model.cfg.dtype in ("bfloat16", "float16") else 4
    return {
        "model": model_name,
        "weights_sha256": model.weights_sha256,
        "dtype": model.cfg.dtype,
        "params": count_params(model.cfg),
        "weight_bytes_per_token": weight_bytes_per_token(model.cfg, itemsize),
        "load_s": load_s,
        "compile_s": first.metrics["compile_s"],
        "tpot_s": best["tpot_s"],
        "tpot_s_all": [m["tpot_s"] for m in runs],
        "decode_tokens_per_s": 1.0 / best["tpot_s"],
        "ttft_s": best["ttft_s"],
        "new_tokens": new_tokens,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "text": first.outputs[0]["text"][:200],
    }


def suite_ar(args) -> dict:
    env = environment()
    bw = measure_bandwidth()
    rows = []
    for name in args.models:
        cmd = [
            sys.executable,
            "-m",
            "ssd_jax.bench",
            "--child-ar",
            name,
            "--new-tokens",
            str(args.new_tokens),
            "--repeats",
            str(args.repeats),
        ] + (["--dtype", args.dtype] if args.dtype else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{name}: failed: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        row = json.loads(r.stdout.strip().splitlines()[-1])
        row["loadavg_after"] = os.getloadavg()
        row["roofline_tpot_s"] = row["weight_bytes_per_token"] / (bw * 1e9)
        row["roofline_fraction"] = row["roofline_tpot_s"] / row["tpot_s"]
        rows.append(row)
        print(
            f"{name}: {row['decode_tokens_per_s']:.2f} tok/s (tpot {row['tpot_s'] * 1e3:.0f} ms, roofline "
            f"{row['roofline_tpot_s'] * 1e3:.0f} ms = {row['roofline_fraction']:.0%}), compile {row['compile_s']:.1f}s, "
            f"peak RSS {row['peak_rss_gb']:.2f} GB, load {row['load_s']:.1f}s",
            file=sys.stderr,
        )
    return {"suite": "ar", "env": env, "bandwidth_gb_s": bw, "rows": rows}


def render_ar(res: dict) -> str:
    e = res["env"]
    lines = [
        f"# AR decode, batch 1, greedy ({e['backend']}, {e['device_kind']}, jax {e['jax']}, commit {e['git_commit']})",
        "",
        f"Measured read bandwidth: {res['bandwidth_gb_s']:.1f} GB/s (best over a reduction and a matrix-vector product streaming 1 GB). "
        f"Load average at start: {', '.join(f'{x:.2f}' for x in e['loadavg'])}.",
        "",
        "| model | dtype | weight GB/token | decode tok/s | tpot ms | roofline tpot ms | % of roofline | compile s "
        "| peak RSS GB | load s | load avg after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['weight_bytes_per_token'] / 1e9:.2f} | {r['decode_tokens_per_s']:.2f} "
            f"| {r['tpot_s'] * 1e3:.0f} | {r['roofline_tpot_s'] * 1e3:.0f} | {r['roofline_fraction']:.0%} "
            f"| {r['compile_s']:.1f} | {r['peak_rss_gb']:.2f} | {r['load_s']:.1f} | {r['loadavg_after'][0]:.2f} |"
        )
    lines += ["", "tpot is the best of the repeated runs (each 1 prompt x new tokens, after a compile run)."]
    return "\n".join(lines) + "\n"


# --- SD suite ---------------------------------------------------------------------------


def _run(model, prompts, sp, spec):
    import ssd_jax

    ssd_jax.generate(
        model, prompts, ssd_jax.SamplingParams(**{**sp.__dict__, "max_new_tokens": 4}), spec
    )  # compile
    return ssd_jax.generate(model, prompts, sp, spec)


def suite_sd(args) -> dict:
    """AR vs SD side by side (same process, interleaved per prompt) on the Qwen pair.

    Per prompt, every method runs back to back, so machine noise hits all of them alike;
    ratios are computed from summed tokens and summed wall time per category.
    """
    import ssd_jax
    from ssd_jax.sampling.filters import SamplingParams
    from ssd_jax.decoding.spec import SpecConfig
    from ssd_jax.data.prompts import copy_task_prompts, load_prompts

    env = environment()
    target = ssd_jax.load_model(args.target)
    draft = ssd_jax.load_model(args.draft)
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    methods = [("ar", SpecConfig())]
    methods += [(f"sd-k{k}", SpecConfig(method="sd", draft=draft, k=k)) for k in args.ks]
    methods += [(f"ngram-k{args.ngram_k}", SpecConfig(method="sd", draft="ngram", k=args.ngram_k))]
    cats = {c: [p["prompt"] for p in load_prompts(c, n=args.n_prompts)] for c in args.categories}
    cats["copy"] = [p["prompt"] if isinstance(p, dict) else p for p in copy_task_prompts(args.n_prompts)]
    rows = []
    for cat, prompts in cats.items():
        for i, prompt in enumerate(prompts):
            for name, spec in methods:
                if cat == "copy" and name.startswith("sd-") and name != f"sd-k{args.ks[len(args.ks) // 2]}":
                    continue
                res = _run(target, [prompt], sp, spec)
                m = res.metrics
                row = {
                    "suite": "sd",
                    "category": cat,
                    "prompt_index": i,
                    "method": name,
                    "batch_size": 1,
                    "loadavg": os.getloadavg(),
                    **{k: v for k, v in m.items()},
                }
                rows.append(row)
                print(
                    f"{cat}[{i}] {name}: {m['tokens_per_s']:.2f} tok/s"
                    + (
                        f", acc {m['acceptance_rate']:.2f}, tau {m['mean_acceptance_length']:.2f}"
                        if "acceptance_rate" in m
                        else ""
                    ),
                    file=sys.stderr,
                )
    # batch sizes: code prompts, AR vs the middle K
    k_mid = args.ks[len(args.ks) // 2]
    code = [p["prompt"] for p in load_prompts("code", n=max(args.batch_sizes))]
    for bs in args.batch_sizes:
        for name, spec in [
            ("ar", SpecConfig()),
            (f"sd-k{k_mid}", SpecConfig(method="sd", draft=draft, k=k_mid)),
        ]:
            res = _run(target, code[:bs], sp, spec)
            m = res.metrics
            rows.append(
                {
                    "suite": "sd-batch",
                    "category": "code",
                    "method": name,
                    "batch_size": bs,
                    "loadavg": os.getloadavg(),
                    **m,
                }
            )
            print(f"batch {bs} {name}: {m['tokens_per_s']:.2f} tok/s", file=sys.stderr)
    return {
        "suite": "sd",
        "env": env,
        "target": target.name,
        "draft": draft.name,
        "weights": {target.name: target.weights_sha256, draft.name: draft.weights_sha256},
        "rows": rows,
    }


def render_sd(res: dict) -> str:
    import collections

    e = res["env"]
    out = [
        f"# SD vs AR ({res['target']} target, {res['draft']} draft; {e['backend']}, jax {e['jax']}, "
        f"commit {e['git_commit']})",
        "",
        "Batch 1, greedy, side by side in one process (every method per prompt back to back). "
        "tok/s is summed tokens over summed wall time per category (prefill included); decode tok/s excludes "
        "the prefill and first token (as the SSD paper reports). Ratios are relative to AR in the same category.",
        "",
        "| category | method | prompts | tok/s | ratio | decode tok/s | decode ratio | acceptance "
        "| tokens/verify step | draft s | verify s | sample s | overhead s | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    agg = collections.defaultdict(lambda: collections.defaultdict(float))
    for r in res["rows"]:
        if r["suite"] != "sd":
            continue
        a = agg[(r["category"], r["method"])]
        a["n"] += 1
        a["tok"] += r["generated_tokens"]
        a["wall"] += r["wall_s"]
        a["dtok"] += r["generated_tokens"] - r["batch_size"]
        a["dwall"] += r["wall_s"] - r["ttft_s"]
        for k in ("draft_s", "verify_s", "sample_s", "overhead_s"):
            a[k] += r.get(k) or 0.0  # None: not measured (SD stage times without profiling)
        a["acc_num"] += r.get("acceptance_rate", 0.0) * r.get("verify_steps", 0) * r.get("k", 0)
        a["acc_den"] += r.get("verify_steps", 0) * r.get("k", 0)
        a["steps"] += r.get("verify_steps", 0)
        a["load"] += r["loadavg"][0]
    for (cat, meth), a in agg.items():
        base = agg[(cat, "ar")]
        tps = a["tok"] / a["wall"]
        ratio = tps / (base["tok"] / base["wall"]) if base["wall"] else float("nan")
        dtps = a["dtok"] / a["dwall"]
        dratio = dtps / (base["dtok"] / base["dwall"]) if base["dwall"] else float("nan")
        acc = f"{a['acc_num'] / a['acc_den']:.2f}" if a["acc_den"] else "-"
        tau = f"{a['dtok'] / a['steps']:.2f}" if a["steps"] else "-"
        out.append(
            f"| {cat} | {meth} | {int(a['n'])} | {tps:.2f} | {ratio:.2f}x | {dtps:.2f} | {dratio:.2f}x | {acc} "
            f"| {tau} | {a['draft_s']:.1f} | {a['verify_s']:.1f} | {a['sample_s']:.2f} | {a['overhead_s']:.2f} "
            f"| {a['load'] / a['n']:.2f} |"
        )
    out += [
        "",
        "## Batch size (code prompts)",
        "",
        "| batch | method | tok/s (throughput, prefill incl.) | per-sequence tok/s | ratio vs AR |",
        "|---|---|---|---|---|",
    ]
    base = {}
    for r in res["rows"]:
        if r["suite"] == "sd-batch":
            tps = r["tokens_per_s"]
            if r["method"] == "ar":
                base[r["batch_size"]] = tps
            ratio = tps / base.get(r["batch_size"], float("nan"))
            out.append(
                f"| {r['batch_size']} | {r['method']} | {tps:.2f} | {tps / r['batch_size']:.2f} | {ratio:.2f}x |"
            )
    out += [
        "",
        "tokens/verify step counts the bonus token (mean acceptance length); acceptance = accepted / drafted. "
        "tokens per verify step for ar is not applicable.",
    ]
    return "\n".join(out) + "\n"


# --- SSD suite --------------------------------------------------------------------------


def _ssd_row(suite, cat, i, name, res, **extra) -> dict:
    m = res.metrics
    keep = {
        k: v for k, v in m.items() if not isinstance(v, dict) or k in ("fanout", "fallback_calls", "devices")
    }
    return {
        "suite": suite,
        "category": cat,
        "prompt_index": i,
        "method": name,
        "loadavg": os.getloadavg(),
        **keep,
        **extra,
    }


def _say(row) -> None:
    m = row
    extra = ""
    if "acceptance_rate" in m:
        extra += f", acc {m['acceptance_rate']:.2f}, tau {m['mean_acceptance_length']:.2f}"
    if "cache_hit_rate" in m:
        extra += (
            f", hit {m['cache_hit_rate']:.2f}, tau hit/miss {m['tau_hit']:.2f}/{m['tau_miss']:.2f}, "
            f"overlap {m['overlap_fraction']:.2f}"
        )
    print(
        f"{m['suite']} {m['category']}[{m.get('prompt_index', '')}] {m['method']} b={m['batch_size']}: "
        f"{m['tokens_per_s']:.2f} tok/s{extra}",
        file=sys.stderr,
    )


def suite_ssd(args) -> dict:
    """AR, SD and SSD side by side (same process, every method per prompt back to back).

    Parts (``--parts``): ``main`` (per category, batch 1, greedy), ``fanout`` (geometric vs
    uniform at T = 0 / 0.7 / 1), ``saguaro`` (the C sweep at T = 1: hit rate against
    acceptance), ``batch`` (batch 1 / 4 / 16 with neural, n-gram and auto backup).
    """
    import ssd_jax
    from ssd_jax.sampling.filters import SamplingParams
    from ssd_jax.decoding.spec import SpecConfig
    from ssd_jax.data.prompts import load_prompts

    env = environment()
    target = ssd_jax.load_model(args.target)
    draft = load_draft(args.draft, target)
    K = args.ssd_k
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    ssd = functools.partial(SpecConfig, method="ssd", draft=draft, k=K)
    rows = []

    def run(part, cat, i, name, prompts, sampling, spec, **extra):
        res = _run(target, prompts, sampling, spec)
        row = _ssd_row(part, cat, i, name, res, temperature=sampling.temperature, **extra)
        rows.append(row)
        _say(row)

    if "main" in args.parts:
        methods = [
            ("ar", SpecConfig()),
            (f"sd-k{K}", SpecConfig(method="sd", draft=draft, k=K)),
            (f"ssd-k{K}", ssd(backup="neural")),
        ]
        for cat in args.categories:
            for i, p in enumerate(load_prompts(cat, n=args.n_prompts)):
                for name, spec in methods:
                    run("main", cat, i, name, [p["prompt"]], sp, spec)
    code = [p["prompt"] for p in load_prompts("code", n=max(args.batch_sizes + [args.n_prompts]))]
    if "fanout" in args.parts:
        for temp in (0.0, 0.7, 1.0):
            s2 = dataclasses.replace(sp, temperature=temp, seed=1)
            for i, p in enumerate(code[: args.n_prompts]):
                for name, spec in [
                    ("sd", SpecConfig(method="sd", draft=draft, k=K)),
                    ("ssd-geometric", ssd(backup="neural")),
                    ("ssd-uniform", ssd(backup="neural", fan_out=2)),
                ]:
                    run("fanout", "code", i, name, [p], s2, spec)
    if "saguaro" in args.parts:
        s2 = dataclasses.replace(sp, temperature=1.0, seed=2)
        for c in (1.0, 0.6, 0.3, 0.0):
            for i, p in enumerate(code[: args.n_prompts]):
                run(
                    "saguaro", "code", i, f"ssd-c{c}", [p], s2, ssd(backup="neural", saguaro_c=c), saguaro_c=c
                )
    if "batch" in args.parts:
        for bs in args.batch_sizes:
            for name, spec in [
                ("ar", SpecConfig()),
                ("sd", SpecConfig(method="sd", draft=draft, k=K)),
                ("ssd-neural", ssd(backup="neural")),
                ("ssd-ngram", ssd(backup="ngram")),
                ("ssd-auto", ssd(backup="auto")),
            ]:
                run("batch", "code", 0, name, code[:bs], sp, spec)
    return {
        "suite": "ssd",
        "env": env,
        "target": target.name,
        "draft": draft.name,
        "k": K,
        "weights": {target.name: target.weights_sha256, draft.name: draft.weights_sha256},
        "rows": rows,
    }


def render_ssd(res: dict) -> str:
    import collections

    e = res["env"]
    out = [
        f"# AR / SD / SSD ({res['target']} target, {res['draft']} draft, K={res['k']}; {e['backend']}, "
        f"jax {e['jax']}, commit {e['git_commit']}, {e['device_count']} device(s), {e['cpu_count']} cores)",
        "",
        "Side by side in one process (every method per prompt back to back). Decode tok/s excludes prefill and "
        "the first token (as the SSD paper reports); ratios are against AR (or SD) in the same group. "
        "hit = cache hit rate over row-rounds; tau = tokens per round on hits / after misses; overlap = share "
        "of the cache build that ran while the target verified (from the device-lane trace).",
        "",
    ]
    groups = collections.defaultdict(list)
    for r in res["rows"]:
        groups[(r["suite"], r["category"], r["temperature"], r["batch_size"], r["method"])].append(r)

    def agg(rs):
        dtok = sum(r["generated_tokens"] - r["batch_size"] for r in rs)
        dwall = sum(r["wall_s"] - r["ttft_s"] for r in rs)
        f = {
            "n": len(rs),
            "dtps": dtok / dwall if dwall > 0 else 0.0,
            "load": sum(r["loadavg"][0] for r in rs) / len(rs),
        }
        for k in (
            "acceptance_rate",
            "mean_acceptance_length",
            "cache_hit_rate",
            "tau_hit",
            "tau_miss",
            "overlap_fraction",
            "draft_s",
            "verify_s",
            "draft_exposed_s",
            "overhead_s",
        ):
            vals = [r[k] for r in rs if r.get(k) is not None]
            f[k] = sum(vals) / len(vals) if vals else None
        return f

    def fmt(x, p=2):
        return "-" if x is None else f"{x:.{p}f}"

    for part in ("main", "fanout", "saguaro", "batch"):
        keys = [k for k in groups if k[0] == part]
        if not keys:
            continue
        out += [
            f"## {part}",
            "",
            "| category | T | batch | method | prompts | decode tok/s | vs AR | vs SD | acceptance "
            "| tokens/round | hit | tau hit | tau miss | overlap | draft s | exposed draft s | verify s | load avg |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for k in sorted(keys, key=lambda k: (k[1], k[2], k[3])):
            a = agg(groups[k])
            base_ar = groups.get(k[:4] + ("ar",))
            sd_name = next((kk[4] for kk in groups if kk[:4] == k[:4] and kk[4].startswith("sd")), None)
            base_sd = groups.get(k[:4] + (sd_name,)) if sd_name else None
            vs_ar = a["dtps"] / agg(base_ar)["dtps"] if base_ar else None
            vs_sd = a["dtps"] / agg(base_sd)["dtps"] if base_sd else None
            out.append(
                f"| {k[1]} | {k[2]} | {k[3]} | {k[4]} | {a['n']} | {a['dtps']:.2f} | {fmt(vs_ar)} "
                f"| {fmt(vs_sd)} | {fmt(a['acceptance_rate'])} | {fmt(a['mean_acceptance_length'])} "
                f"| {fmt(a['cache_hit_rate'])} | {fmt(a['tau_hit'])} | {fmt(a['tau_miss'])} "
                f"| {fmt(a['overlap_fraction'])} | {fmt(a['draft_s'], 1)} | {fmt(a['draft_exposed_s'], 1)} "
                f"| {fmt(a['verify_s'], 1)} | {a['load']:.2f} |"
            )
        out.append("")
    return "\n".join(out) + "\n"


def render(res: dict) -> str:
    """The markdown report of a results file of any suite."""
    return {"ar": render_ar, "sd": render_sd, "ssd": render_ssd}[res["suite"]](res)


def rerender(path: str) -> None:
    """Re-render a results JSON (e.g. after changing the table layout) without re-running it."""
    with open(path) as f:
        res = json.load(f)
    with open(path[:-5] + ".md", "w") as f:
        f.write(render(res))
