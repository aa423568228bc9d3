"""The GPU check for a bare machine (issue 13, item 5): one command, no network, no carried weights.

    python3 tools/gpu_check.py            # or: bash experiments/gpu_check.sh
    python3 tools/gpu_check.py --smoke    # the same code path on CPU with tiny shapes, seconds

Steps, each in its own child process under a timeout (a hung or slow step costs only its
limit; the steps after it still run, and what a step finished before it was killed is kept):

1. ``device``: jax version, backend and devices; an HBM bandwidth probe (best of several
   timed reductions and copies of a multi-GB bf16 array: GB/s read, and read + write).
2. ``build``: random-weight Hugging Face model folders (``config.json`` + ``model.safetensors``,
   bf16, no tokenizer) with the shapes of Qwen2.5-1.5B (the target) and Qwen2.5-0.5B (an
   unrelated draft), written by a small safetensors writer (the format is a JSON header and
   raw bytes), so nothing needs the network or carried weights. About 10 s per GB here.
3. ``engine``: the real engine loops on the loaded folders (token-id prompts, greedy,
   ``ignore_eos``), each compiled by one untimed run first and timed over repeats: AR; SD and
   SSD with draft = target (acceptance ~1) and with the unrelated 0.5B draft (acceptance ~0);
   SD and SSD with ``profile_stages`` for the draft (SSD: build) / verify / sample / host split
   (the default loops make one call per round and report no stage times). Every row has decode
   and end-to-end tok/s, acceptance, tokens per round, compiled calls per round, the stage times
   per round where profiled, and host time per round (wall minus the measured device stages).
4. ``forward`` (not in ``--smoke``): the performance model's synthetic-weight forward timings
   (``python -m ssd_jax.perfmodel --measure``), if time is left.

One results file: ``<out>/gpu_check.json`` and its table ``<out>/gpu_check.md`` (``<out>`` =
``$OUT`` when set, which the device tool brings back, else ``experiments/results/gpu/``), plus
the log ``gpu_check.log``. The whole run stays under ``--budget-s`` (default 450 s), compiles
included; each step gets at most what is left.

Every results file records the commit (``git rev-parse HEAD``, or "unknown" outside a git
checkout), the jax version and the XLA flags the engine ran with (``XLA_FLAGS`` after
``ssd_jax``'s own defaults), so a number can be traced to the code and settings that gave it.

Where it has run: as ``--smoke`` on CPU, in the test suite (tests/test_gpu_check.py) and by hand on
the 2-core development machine; and once in full, on one NVIDIA H200 with jax 0.11.2 (2026-12-04,
363 s of the 450 s budget, every step ok, commit e5b1a7b; its files are in experiments/results/gpu/,
read in docs/performance.md). That run's json predates the commit / jax / XLA-flag fields above.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATUS = (
    "ran once in full on one NVIDIA H200 (2026-12-04, experiments/results/gpu/); --smoke runs in the tests"
)

QWEN_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
)
QWEN_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
)
TINY_T = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TINY_D = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)

FULL = {
    "target": QWEN_15B,
    "draft": QWEN_05B,
    "prompt_len": 128,
    "new_tokens": 128,
    "repeats": 3,
    "k": 4,
    "bw_gbytes": 4.0,
    "limits": {"device": 60, "build": 120, "engine": 300, "forward": 90},
}
SMOKE = {
    "target": TINY_T,
    "draft": TINY_D,
    "prompt_len": 12,
    "new_tokens": 8,
    "repeats": 1,
    "k": 2,
    "bw_gbytes": 0.02,
    "limits": {"device": 30, "build": 30, "engine": 120},
}


# --- step 1: random-weight HF folders ---------------------------------------------------------


def hf_config(shape: dict) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": 0,
        "attention_bias": True,
        **shape,
    }


def tensor_shapes(shape: dict) -> list[tuple[str, tuple[int, ...], int]]:
    """(HF name, shape, fan-in) of every tensor of a tied Qwen2 checkpoint."""
    H, F, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd = H // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (V, H), H), ("model.norm.weight", (H,), 0)]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (H,), 0),
            (p + "post_attention_layernorm.weight", (H,), 0),
            (p + "self_attn.q_proj.weight", (H, H), H),
            (p + "self_attn.q_proj.bias", (H,), H),
            (p + "self_attn.k_proj.weight", (kv, H), H),
            (p + "self_attn.k_proj.bias", (kv,), H),
            (p + "self_attn.v_proj.weight", (kv, H), H),
            (p + "self_attn.v_proj.bias", (kv,), H),
            (p + "self_attn.o_proj.weight", (H, H), H),
            (p + "mlp.gate_proj.weight", (F, H), H),
            (p + "mlp.up_proj.weight", (F, H), H),
            (p + "mlp.down_proj.weight", (H, F), F),
        ]
    return out


def write_random_hf(path: Path, shape: dict, seed: int) -> dict:
    """A bf16 Qwen2 folder with random weights; returns its size. Values: each tensor draws bytes
    uniformly and maps them through a 256-entry table of N(0, 1/fan_in) quantiles (fast: no
    per-element normal sampling); norms are 1."""
    import ml_dtypes
    import numpy as np

    from statistics import NormalDist

    rng = np.random.default_rng(seed)
    q = np.array([NormalDist().inv_cdf((i + 0.5) / 256) for i in range(256)], np.float32)
    path.mkdir(parents=True, exist_ok=True)
    specs = tensor_shapes(shape)
    header, off = {}, 0
    for name, shp, _ in specs:
        n = int(np.prod(shp)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for _name, shp, fan_in in specs:
            if fan_in == 0:
                arr = np.ones(shp, ml_dtypes.bfloat16)
            else:
                table = (q / np.sqrt(fan_in)).astype(ml_dtypes.bfloat16)
                arr = table[rng.integers(0, 256, size=shp, dtype=np.uint8)]
            f.write(arr.tobytes())
    (path / "config.json").write_text(json.dumps(hf_config(shape), indent=1))
    return {"path": str(path), "bytes": off, "params": off // 2}


def step_build(cfg: dict, work: Path) -> dict:
    out = {}
    for role, seed in (("target", 0), ("draft", 1)):
        t = time.perf_counter()
        out[role] = write_random_hf(work / f"random-{role}", cfg[role], seed)
        out[role]["write_s"] = time.perf_counter() - t
        print(f"built {role}: {out[role]['bytes'] / 1e9:.2f} GB in {out[role]['write_s']:.1f} s", flush=True)
    return out


# --- step 2: the device and its bandwidth -----------------------------------------------------


def step_device(cfg: dict, work: Path) -> dict:
    import jax
    import jax.numpy as jnp

    devs = jax.devices()
    n = int(cfg["bw_gbytes"] * 1e9 / 2) // 4096 * 4096
    x = jnp.ones((4096, n // 4096), jnp.bfloat16)
    kernels = {
        "read (sum)": (jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), 1),
        "read+write (copy)": (jax.jit(lambda a: a * jnp.bfloat16(1.5)), 2),
    }
    bw = {}
    for name, (f, passes) in kernels.items():
        jax.block_until_ready(f(x))
        best = float("inf")
        for _ in range(7):
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            best = min(best, time.perf_counter() - t)
        bw[name] = passes * n * 2 / best / 1e9
        print(f"{name}: {bw[name]:.0f} GB/s", flush=True)
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devs],
        "device_kind": devs[0].device_kind,
        "probe_bytes": n * 2,
        "bandwidth_gb_s": bw,
    }


# --- step 3: the engine loops -----------------------------------------------------------------


def _row(name: str, res, extra: dict) -> dict:
    m = res.metrics
    rounds = m.get("verify_steps") or 0
    row = {
        "method": name,
        **extra,
        **{
            k: m.get(k)
            for k in (
                "decode_tokens_per_s",
                "tokens_per_s",
                "ttft_s",
                "wall_s",
                "generated_tokens",
                "acceptance_rate",
                "mean_acceptance_length",
                "verify_steps",
                "draft_s",
                "draft_exposed_s",
                "verify_s",
                "sample_s",
                "overhead_s",
                "overlap_fraction",
                "cache_hit_rate",
                "compile_s",
                "calls_per_round",
            )
        },
    }
    decode_s = m["wall_s"] - m["ttft_s"]
    if rounds:
        row["decode_s_per_round"] = decode_s / rounds
        for k in ("draft_s", "verify_s", "overhead_s"):
            if m.get(k) is not None:
                row[k.replace("_s", "_s_per_round")] = m[k] / rounds
    else:
        row["decode_s_per_token"] = decode_s / max(1, m["generated_tokens"] - 1)
    return row


def step_engine(cfg: dict, work: Path) -> dict:
    import numpy as np

    import ssd_jax
    from ssd_jax import SamplingParams, SpecConfig, generate

    rows_path = work / "engine_rows.jsonl"
    t = time.perf_counter()
    target = ssd_jax.load_model(str(work / "random-target"), dtype="bfloat16")
    draft = ssd_jax.load_model(str(work / "random-draft"), dtype="bfloat16")
    load_s = time.perf_counter() - t
    print(f"loaded both models in {load_s:.1f} s", flush=True)
    V, P, N, K = target.cfg.vocab_size, cfg["prompt_len"], cfg["new_tokens"], cfg["k"]
    prompt = np.random.default_rng(7).integers(2, V, size=P).tolist()
    sp = SamplingParams(max_new_tokens=N, ignore_eos=True)
    methods = [
        ("ar", SpecConfig()),
        ("sd draft=target", SpecConfig(method="sd", draft=target, k=K)),
        ("sd draft=unrelated", SpecConfig(method="sd", draft=draft, k=K)),
        # the neural backup: every round is then one call on one device (the n-gram backup of
        # "auto" reads each round's tokens on the host before the lookup)
        ("ssd draft=target", SpecConfig(method="ssd", draft=target, k=K, backup="neural")),
        ("ssd draft=unrelated", SpecConfig(method="ssd", draft=draft, k=K, backup="neural")),
        (
            "sd draft=unrelated, profiled stages",
            SpecConfig(method="sd", draft=draft, k=K, profile_stages=True),
        ),
        # SSD's stages as separate calls on a timeline: build against verify
        (
            "ssd draft=unrelated, profiled stages",
            SpecConfig(method="ssd", draft=draft, k=K, backup="neural", profile_stages=True),
        ),
    ]
    ref = None
    for name, spec in methods:
        t = time.perf_counter()
        first = generate(target, [prompt], sp, spec)
        warm_s = time.perf_counter() - t
        ids = first.outputs[0]["token_ids"]
        ref = ids if ref is None else ref
        for r in range(cfg["repeats"]):
            res = generate(target, [prompt], sp, spec)
            row = _row(
                name, res, {"repeat": r, "k": K, "first_call_s": warm_s, "same_tokens_as_ar": ids == ref}
            )
            with open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{name} r{r}: {row['decode_tokens_per_s']:.1f} decode tok/s, acceptance "
                f"{row['acceptance_rate']}",
                flush=True,
            )
    # the flags the engine's programs compiled with (ssd_jax adds its defaults on import)
    return {"load_s": load_s, "prompt_len": P, "new_tokens": N, "xla_flags": os.environ.get("XLA_FLAGS", "")}


STEPS = {"build": step_build, "device": step_device, "engine": step_engine}


# --- the driver -------------------------------------------------------------------------------


def commit() -> str:
    """The checkout's commit (with ``+dirty`` for uncommitted changes to tracked files), or "unknown"."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=30
        )
        if head.returncode:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
        ).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def jax_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jax")
    except PackageNotFoundError:
        return "unknown"


def run_step(name: str, cfg: dict, work: Path, limit: float, log) -> dict:
    """Run one step in a child process under ``limit`` seconds; its result (or why not)."""
    res_file = work / f"step_{name}.json"
    res_file.unlink(missing_ok=True)
    if name == "forward":
        cmd = [
            sys.executable,
            "-m",
            "ssd_jax.perfmodel",
            "--measure",
            "qwen2.5-coder-1.5b-instruct",
            "qwen2.5-coder-0.5b-instruct",
            "--dtype",
            "bfloat16",
            "--out",
            str(res_file),
        ]
    else:
        cmd = [sys.executable, __file__, "--step", name, "--cfg", json.dumps(cfg), "--work", str(work)]
    t = time.perf_counter()
    print(f"=== {name} (limit {limit:.0f} s)", file=log, flush=True)
    try:
        p = subprocess.run(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=max(1.0, limit),
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
        )
        status = "ok" if p.returncode == 0 else f"failed (rc {p.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {limit:.0f} s"
    out = {"status": status, "seconds": time.perf_counter() - t}
    if res_file.is_file():
        out["result"] = json.loads(res_file.read_text())
    print(f"=== {name}: {status} in {out['seconds']:.1f} s", file=log, flush=True)
    return out


def render(res: dict) -> str:
    dev = (res["steps"].get("device") or {}).get("result", {})
    lines = [
        f"# GPU check ({'SMOKE, CPU, tiny shapes' if res['smoke'] else 'Qwen2.5-1.5B / 0.5B shapes, bf16'})",
        "",
        f"**Status: {res['status']}.**",
        "",
        f"Device: {dev.get('backend', '?')} {dev.get('device_kind', '?')}, jax {dev.get('jax', '?')}; "
        f"total {res['total_s']:.0f} s of a {res['budget_s']:.0f} s budget.",
        "",
        f"Commit {res['commit']}, jax {res['jax']}, XLA_FLAGS `{res['xla_flags'] or '(none)'}`.",
        "",
        "| step | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v['status']} | {v['seconds']:.1f} |" for k, v in res["steps"].items()]
    if dev.get("bandwidth_gb_s"):
        lines += [
            "",
            "Bandwidth probe (best of 7, "
            f"{dev['probe_bytes'] / 1e9:.2f} GB bf16): "
            + ", ".join(f"{k} {v:.0f} GB/s" for k, v in dev["bandwidth_gb_s"].items()),
        ]
    if res["engine_rows"]:
        f = lambda x, p=3: "-" if x is None else (f"{x:.{p}f}" if isinstance(x, float) else str(x))
        lines += [
            "",
            "| method | repeat | decode tok/s | e2e tok/s | ttft s | acceptance | tokens/round "
            "| decode s/round | draft (SSD: build) s/round | verify s/round | host s/round | same tokens as AR "
            "| first call s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["engine_rows"]:
            lines.append(
                f"| {r['method']} | {r['repeat']} | {f(r['decode_tokens_per_s'], 1)} | {f(r['tokens_per_s'], 1)} "
                f"| {f(r['ttft_s'])} | {f(r['acceptance_rate'], 2)} | {f(r['mean_acceptance_length'], 2)} "
                f"| {f(r.get('decode_s_per_round'), 4)} | {f(r.get('draft_s_per_round'), 4)} "
                f"| {f(r.get('verify_s_per_round'), 4)} | {f(r.get('overhead_s_per_round'), 4)} "
                f"| {r['same_tokens_as_ar']} | {f(r['first_call_s'], 1)} |"
            )
        lines += [
            "",
            "host s/round: wall time of the decode minus the measured device stages (SD with profiled "
            "stages; SSD from its device-lane timeline); '-' where the loop does not split it. AR rows: "
            "decode s/token = 1 / decode tok/s.",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: the same code path in seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "experiments" / "results" / "gpu"))
    ap.add_argument(
        "--work", default=None, help="where the model folders go (default: a temp dir; not under --out)"
    )
    ap.add_argument("--budget-s", type=float, default=450.0)
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.step:  # a child: one step, its result in <work>/step_<name>.json
        work = Path(a.work)
        res = STEPS[a.step](json.loads(a.cfg), work)
        (work / f"step_{a.step}.json").write_text(json.dumps(res, indent=1))
        return 0
    t0 = time.perf_counter()
    cfg = SMOKE if a.smoke else FULL
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    work = Path(a.work or tempfile.mkdtemp(prefix="ssd_jax_gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "engine_rows.jsonl").unlink(missing_ok=True)
    if a.smoke:  # one plain CPU device, whatever the caller's (e.g. the test suite's 8 fake devices)
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        )
    steps = {}
    with open(out / "gpu_check.log", "w") as log:
        for name, limit in cfg["limits"].items():
            left = a.budget_s - (time.perf_counter() - t0)
            if left < 10:
                steps[name] = {"status": "skipped: budget spent", "seconds": 0.0}
                continue
            if name == "engine" and steps.get("build", {}).get("status") != "ok":
                steps[name] = {"status": "skipped: no model folders", "seconds": 0.0}
                continue
            steps[name] = run_step(name, cfg, work, min(limit, left), log)
    rows_file = work / "engine_rows.jsonl"
    rows = (
        [json.loads(x) for x in rows_file.read_text().splitlines() if x.strip()]
        if rows_file.is_file()
        else []
    )
    if not a.work:  # the model folders (GBs) in a temp dir of our own
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    dev = steps.get("device", {}).get("result", {})
    if a.smoke:
        status = "smoke run (CPU, tiny shapes): checks the code path, not speed"
    elif dev.get("backend") not in (None, "cpu"):
        status = f"ran on {dev['backend']} ({dev.get('device_kind')})"
    else:
        status = STATUS + f"; this run's backend: {dev.get('backend')}"
    engine = steps.get("engine", {}).get("result", {})
    res = {
        "status": status,
        "smoke": a.smoke,
        "commit": commit(),
        "jax": jax_version(),
        "xla_flags": engine.get("xla_flags", os.environ.get("XLA_FLAGS", "")),
        "config": cfg,
        "budget_s": a.budget_s,
        "total_s": time.perf_counter() - t0,
        "steps": steps,
        "engine_rows": rows,
    }
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1))
    (out / "gpu_check.md").write_text(render(res))
    print(render(res))
    return 0 if all(s["status"] == "ok" for s in steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
