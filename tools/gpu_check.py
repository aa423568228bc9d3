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
4. ``exactness``: exactness apart from numerics, in float32 and bfloat16, on a random Llama
   (vocabulary 2048, width 256, 4 layers) whose head is peaked (the final norm scaled so the logits'
   standard deviation is about 6: a greedy tie is rare, T = 1 still samples among several tokens)
   and a draft = target + noise: (a) numerics: the target's logits for K + 1 tokens scored in one
   forward (a verify) against the same positions decoded one token at a time (max abs difference,
   argmax agreement), and the top-1 margins of the greedy positions (their minimum, and how many lie
   within that difference: where rounding could flip a greedy choice); (b) greedy SD and SSD tokens
   against greedy AR (mismatching positions); (c) SD's emissions at T = 1 against the target with
   the test suite's goodness-of-fit test (``tests/reference.py``: randomised PIT, chi-square and KS,
   pooled and per round offset), scored by the float64 numpy reference and by the model in its own
   dtype, and the same tokens redrawn at a known total-variation bias, a control that must fail.
5. ``cmdbuf``: AR decode tok/s of the 1.5B-shaped target and of the round-cost tiny model in two
   child runs, XLA's default flags and ``--xla_gpu_enable_command_buffer=`` (command buffers, i.e.
   CUDA graphs, off). The flag is GPU-only (on CPU both runs compile the same program, and the
   result says so); XLA aborts on a flag it does not define, so it is added only where the
   installed XLA knows it.
6. ``roundcost``: the round-cost benchmark's one-device layout (``ssd_jax.bench.roundcost``, its
   tiny model as its own draft): wall ms per round of AR, SD and SSD, compiled calls and host syncs
   per round, and the stage split of a ``profile_stages`` run; its table as the benchmark prints it.
7. ``forward`` (not in ``--smoke``): the performance model's synthetic-weight forward timings
   (``python -m ssd_jax.perfmodel --measure``), only if at least 60 s are left (skipping it is not a
   failure).

One results file: ``<out>/gpu_check.json`` and its table ``<out>/gpu_check.md`` (``<out>`` =
``$OUT`` when set, which the device tool brings back, else ``experiments/results/gpu/``), plus
the log ``gpu_check.log``. The whole run stays under ``--budget-s`` (default 480 s), compiles
included; each step gets at most its own limit and what is left.

Every results file records the commit (``git rev-parse HEAD``, or "unknown" outside a git
checkout), the jax version and the XLA flags the engine ran with (``XLA_FLAGS`` after
``ssd_jax``'s own defaults), so a number can be traced to the code and settings that gave it.

Where it has run: as ``--smoke`` on CPU, in the test suite (tests/test_gpu_check.py) and by hand on
the 2-core development machine; and once in full, on one NVIDIA H200 with jax 0.11.2 (2026-12-04,
363 s of the 450 s budget, every step ok, commit e5b1a7b; its files are in experiments/results/gpu/,
read in docs/performance.md). That run's json predates the commit / jax / XLA-flag fields above,
and steps 4-6 (issue 48), which have run only as ``--smoke`` on CPU: no GPU numbers for them yet.
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
    "ran once in full on one NVIDIA H200 (2026-12-04, experiments/results/gpu/), before the exactness, "
    "cmdbuf and roundcost steps (not run on a GPU yet); --smoke runs in the tests"
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
    "roundcost": {"tokens": 64, "k": 4, "repeats": 3},
    "cmdbuf_tiny": True,
    "exactness": {
        "shape": {"vocab": 2048, "hidden": 256, "layers": 4, "heads": 8},
        "logit_std": 6.0,
        "draft_noise": 0.02,
        "k": 4,
        "prompt_len": 16,
        "prompts": 8,
        "greedy_tokens": 64,
        "rows": 32,
        "tokens": 32,
        "control_tv": 0.05,
    },
    # in this order; each step gets at most what is left of the budget
    "limits": {
        "device": 60,
        "build": 120,
        "engine": 300,
        "exactness": 100,
        "cmdbuf": 70,
        "roundcost": 45,
        "forward": 90,
    },
}
SMOKE = {
    "target": TINY_T,
    "draft": TINY_D,
    "prompt_len": 12,
    "new_tokens": 8,
    "repeats": 1,
    "k": 2,
    "bw_gbytes": 0.02,
    "roundcost": {"tokens": 4, "k": 2, "repeats": 1},
    "cmdbuf_tiny": False,
    "exactness": {
        "shape": {"vocab": 64, "hidden": 64, "layers": 1, "heads": 4},
        "logit_std": 4.0,
        "draft_noise": 0.02,
        "k": 2,
        "prompt_len": 6,
        "prompts": 4,
        "greedy_tokens": 12,
        "rows": 8,
        "tokens": 16,
        "control_tv": 0.2,
    },
    "limits": {"device": 30, "build": 30, "engine": 120, "exactness": 120, "cmdbuf": 90, "roundcost": 60},
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


# --- step 4: the round-cost benchmark's one-device layout --------------------------------------


def step_roundcost(cfg: dict, work: Path) -> dict:
    """``ssd_jax.bench.roundcost`` at its ``one`` layout on its tiny model (its own draft: every
    proposal accepted, compute about zero, so a round's wall time is the engine's cost)."""
    from ssd_jax.bench import roundcost as rc

    c = cfg["roundcost"]
    case = rc.Case("tiny", None, c["tokens"], c["k"], c["repeats"])
    rows = rc.measure_layout(case, "one")
    return {
        "case": c,
        "rows": rows,
        "table": rc.report(rows, f"tiny model, one device, {c['tokens']} tokens"),
    }


# --- step 5: AR with and without XLA's command buffers -----------------------------------------

#: an empty value turns XLA:GPU's command buffers (CUDA graphs) off; a GPU-only flag
CMDBUF_FLAG = "--xla_gpu_enable_command_buffer="


def step_ar_decode(cfg: dict, work: Path) -> dict:
    """AR decode tok/s of the random target folder and of the round-cost tiny model in this process
    (under whatever ``XLA_FLAGS`` the parent gave it): one untimed compile run, then the repeats."""
    import jax
    import numpy as np

    import ssd_jax
    from ssd_jax import SamplingParams, generate
    from ssd_jax.bench.roundcost import tiny_model

    models = {"random target (bf16)": ssd_jax.load_model(str(work / "random-target"), dtype="bfloat16")}
    if cfg["cmdbuf_tiny"]:  # where launch overhead is all there is
        models["roundcost tiny (f32)"] = tiny_model()
    out = {"backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}
    for name, model in models.items():
        V = model.cfg.vocab_size
        prompt = np.random.default_rng(7).integers(2, V, size=cfg["prompt_len"]).tolist()
        sp = SamplingParams(max_new_tokens=cfg["new_tokens"], ignore_eos=True)
        t = time.perf_counter()
        generate(model, [prompt], sp)
        first = time.perf_counter() - t
        tps = [generate(model, [prompt], sp).metrics["decode_tokens_per_s"] for _ in range(cfg["repeats"])]
        out["rows"].append({"model": name, "first_call_s": first, "decode_tok_s": tps})
        print(f"{name}: {max(tps):.1f} decode tok/s (best of {len(tps)})", flush=True)
    return out


def step_cmdbuf(cfg: dict, work: Path) -> dict:
    """Two children measure AR decode: XLA's default flags, and ``CMDBUF_FLAG`` added. XLA aborts
    on a flag it does not define, so the flag is added only where the installed XLA knows it."""
    from ssd_jax import xla_env

    known = xla_env._xla_knows(CMDBUF_FLAG.strip("-=")) and os.environ.get("SSD_JAX_NO_CMDBUF_FLAG") != "1"
    base = os.environ.get("XLA_FLAGS", "")
    variants = {"default": base}
    if known:
        variants["command buffers off"] = f"{base} {CMDBUF_FLAG}".strip()
    out = {"flag": CMDBUF_FLAG, "flag_known": known, "variants": {}}
    for name, flags in variants.items():
        res_file = work / "step_ar_decode.json"
        res_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--step", "ar_decode", "--cfg", json.dumps(cfg), "--work", str(work)]
        t = time.perf_counter()
        # each child gets half the step's limit, less a margin: none outlives this step
        limit = max(1.0, (cfg.get("step_limit_s", cfg["limits"]["cmdbuf"]) - 5) / len(variants))
        p = subprocess.run(cmd, env={**os.environ, "XLA_FLAGS": flags}, timeout=limit)
        v = {"rc": p.returncode, "seconds": time.perf_counter() - t}
        if res_file.is_file():
            v.update(json.loads(res_file.read_text()))
        out["variants"][name] = v
        if p.returncode:
            raise SystemExit(f"cmdbuf: the {name!r} child failed (rc {p.returncode})")
    backend = out["variants"]["default"].get("backend")
    if not known:
        out["note"] = "the installed XLA does not define the flag: only the default run"
    elif backend != "gpu":
        out["note"] = f"not applicable on {backend}: the flag is GPU-only (both runs are the same program)"
    return out


# --- step 6: exactness apart from numerics ----------------------------------------------------


def reference():
    """The test suite's independent references (``tests/reference.py``): the float64 numpy forward,
    the goodness-of-fit test and its biased redraws."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import reference as ref

    return ref


def peaked_model(e: dict, dtype: str, seed: int = 11):
    """A random Llama in ``dtype`` whose final norm is scaled so the logits' standard deviation is
    about ``e["logit_std"]``: a peaked head, so a greedy tie (top-1 margin below the dtype's
    rounding) is rare while T = 1 still samples among several tokens."""
    import jax.numpy as jnp

    from ssd_jax.loading.loaded import LoadedModel
    from ssd_jax.models.config import ModelConfig
    from ssd_jax.models.params import init_params

    s = e["shape"]
    cfg = ModelConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=2 * s["hidden"],
        num_layers=s["layers"], num_heads=s["heads"], num_kv_heads=2, head_dim=s["hidden"] // s["heads"],
        max_position_embeddings=512, eos_token_ids=(1,), dtype=dtype,
    )  # fmt: skip
    scale = 0.15
    params = init_params(cfg, seed, scale=scale)
    peak = e["logit_std"] / (scale * s["hidden"] ** 0.5)  # unit-RMS hidden x N(0, scale) head rows
    params["final_norm"] = (params["final_norm"].astype(jnp.float32) * peak).astype(cfg.jnp_dtype)
    return LoadedModel(f"peaked-{dtype}", cfg, params, None, f"seed{seed}/peak{peak:.2f}", "")


def verify_vs_decode(model, seqs, P: int, K: int) -> dict:
    """The target's logits for the K + 1 tokens after a P-token prefix, scored in one forward (as a
    verify does) and one token at a time (as AR decodes), on the same cache; and the top-1 margins
    (top-1 minus top-2 logit) of every generated position, from one forward over each whole row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models import llama

    cfg = model.cfg
    toks = jnp.asarray(seqs, jnp.int32)
    B, S = toks.shape

    @jax.jit
    def score(params, x, cache):
        h, cache = llama.forward(params, cfg, x, cache)
        return llama.logits(params, cfg, h), cache.with_lengths(cache.lengths + x.shape[1])

    _, pre = score(model.params, toks[:, :P], llama.init_cache(cfg, B, S + 8))
    ver, _ = score(model.params, toks[:, P : P + K + 1], pre)
    dec, c = [], pre
    for i in range(K + 1):
        lg, c = score(model.params, toks[:, P + i : P + i + 1], c)
        dec.append(lg)
    ver, dec = np.asarray(ver, np.float64), np.asarray(jnp.concatenate(dec, axis=1), np.float64)
    full, _ = score(model.params, toks, llama.init_cache(cfg, B, S + 8))
    top2 = np.sort(np.asarray(full, np.float64)[:, P - 1 : S - 1], axis=-1)[..., -2:]
    margin, diff = top2[..., 1] - top2[..., 0], float(np.abs(ver - dec).max())
    return {
        "positions": int(B * (K + 1)),
        "max_abs_diff": diff,
        "argmax_agreement": float((ver.argmax(-1) == dec.argmax(-1)).mean()),
        "logit_std": float(np.asarray(full, np.float64).std()),
        "min_top1_margin": float(margin.min()),
        "margin_positions": int(margin.size),
        # where rounding could flip a greedy choice: margins within the verify-decode difference
        "margins_below_diff": int((margin <= diff).sum()),
    }


def own_dtype_emissions(model, prompts, outputs, em):
    """``em``'s tokens scored against the model's own distribution in its own dtype (one forward
    over each whole row, T = 1, no filter) instead of the float64 reference: in bfloat16 the
    reference test also sees rounding, this one only the sampler (and verify-vs-forward shapes)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models import llama

    ref = reference()

    n = len(outputs) // len(prompts)
    rows = [list(prompts[i // n]) + list(o["token_ids"][:-1]) for i, o in enumerate(outputs)]
    toks = jnp.asarray(rows, jnp.int32)  # equal lengths: equal prompts, ignore_eos
    cfg, P = model.cfg, len(prompts[0])
    h, _ = jax.jit(lambda p, x, c: llama.forward(p, cfg, x, c))(
        model.params, toks, llama.init_cache(cfg, *toks.shape)
    )
    lg = np.asarray(llama.logits(model.params, cfg, h), np.float64)[:, P - 1 :]
    probs = ref.filtered_probs(lg.reshape(-1, lg.shape[-1]), 1.0)
    return ref.Emissions(probs, em.tokens, em.offsets)


def _fit(rep) -> dict:
    return {
        "n": rep.n, "pooled_p": list(rep.pooled), "min_p": min(rep.pvalues), "tests": len(rep.pvalues),
        "alpha": rep.alpha, "passed": not rep.rejected, "outside_support": rep.outside_support,
    }  # fmt: skip


def _mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    """Positions where two sets of rows differ (a length difference counts every missing position)."""
    return sum(sum(x != y for x, y in zip(r, s)) + abs(len(r) - len(s)) for r, s in zip(a, b))


def exactness_one(e: dict, dtype: str) -> dict:
    """One dtype: numerics (verify vs decode logits, top-1 margins), greedy SD / SSD tokens against
    greedy AR, and SD's T = 1 emissions against the target (``tests/reference.py``'s goodness-of-fit
    test, with its biased redraw as the negative control that must fail)."""
    import numpy as np

    from ssd_jax import SamplingParams, SpecConfig, generate

    ref = reference()
    collect, goodness_of_fit, noisy_copy = ref.collect, ref.goodness_of_fit, ref.noisy_copy

    target = peaked_model(e, dtype)
    draft = noisy_copy(target, e["draft_noise"], seed=12)
    K, P = e["k"], e["prompt_len"]
    rng = np.random.default_rng(13)
    prompts = [rng.integers(2, e["shape"]["vocab"], size=P).tolist() for _ in range(e["prompts"])]
    greedy = SamplingParams(max_new_tokens=e["greedy_tokens"], ignore_eos=True)
    ar = [o["token_ids"] for o in generate(target, prompts, greedy).outputs]
    out = {"dtype": dtype, "k": K, **verify_vs_decode(target, [p + a for p, a in zip(prompts, ar)], P, K)}
    sd = generate(target, prompts, greedy, SpecConfig(method="sd", draft=draft, k=K))
    ssd = generate(target, prompts, greedy, SpecConfig(method="ssd", draft=draft, k=K, backup="neural"))
    out.update(
        greedy_tokens=sum(map(len, ar)),
        sd_mismatches=_mismatches([o["token_ids"] for o in sd.outputs], ar),
        ssd_mismatches=_mismatches([o["token_ids"] for o in ssd.outputs], ar),
        greedy_sd_acceptance=sd.metrics.get("acceptance_rate"),
    )
    sp = SamplingParams(temperature=1.0, n=e["rows"], max_new_tokens=e["tokens"], ignore_eos=True, seed=21)
    res = generate(target, prompts, sp, SpecConfig(method="sd", draft=draft, k=K))
    em = collect(target, prompts, res.outputs, K, sp)
    ctrl = goodness_of_fit(em.biased(e["control_tv"], "to_tail", np.random.default_rng(22)), seed=21)
    out["gof"] = {**_fit(goodness_of_fit(em, seed=21)), "acceptance": res.metrics.get("acceptance_rate")}
    out["gof_own_dtype"] = _fit(
        goodness_of_fit(own_dtype_emissions(target, prompts, res.outputs, em), seed=21)
    )
    out["control"] = {"kind": "to_tail", "tv": e["control_tv"], **_fit(ctrl)}
    print(f"exactness {dtype}: {json.dumps(out)}", flush=True)
    return out


def step_exactness(cfg: dict, work: Path) -> dict:
    rows = []
    for dtype in ("float32", "bfloat16"):
        rows.append(exactness_one(cfg["exactness"], dtype))
        (work / "step_exactness.json").write_text(json.dumps({"config": cfg["exactness"], "rows": rows}))
    return {"config": cfg["exactness"], "rows": rows}


STEPS = {
    "build": step_build,
    "device": step_device,
    "engine": step_engine,
    "roundcost": step_roundcost,
    "ar_decode": step_ar_decode,
    "cmdbuf": step_cmdbuf,
    "exactness": step_exactness,
}
#: steps that may be skipped when the budget is short (not a failure), with the least time each needs
OPTIONAL = {"forward": 60.0}
#: steps that need the model folders of ``build``
NEEDS_BUILD = ("engine", "cmdbuf")


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
        child_cfg = json.dumps({**cfg, "step_limit_s": limit})
        cmd = [sys.executable, __file__, "--step", name, "--cfg", child_cfg, "--work", str(work)]
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


def smoke_xla_flags() -> str:
    """XLA:CPU at its cheapest compile: the lowest optimisation level, and the older loop emitters
    for fusions where the installed XLA knows that flag (as the test suite runs)."""
    from ssd_jax.xla_env import _xla_knows

    flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if _xla_knows("xla_cpu_use_fusion_emitters"):
        flags += " --xla_cpu_use_fusion_emitters=false"
    return flags


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
    lines += render_exactness(res) + render_cmdbuf(res)
    rc = (res["steps"].get("roundcost") or {}).get("result") or {}
    if rc.get("table"):  # the round-cost benchmark's own table, its title one level down
        lines += ["", "#" + rc["table"].rstrip("\n")]
    return "\n".join(lines) + "\n"


def _fmt(x, p: int = 3) -> str:
    return "-" if x is None else (f"{x:.{p}g}" if isinstance(x, float) else str(x))


def render_exactness(res: dict) -> list[str]:
    """The exactness step's table: numerics (verify against decode) beside exactness (greedy tokens,
    goodness of fit at T = 1 and its biased control)."""
    ex = (res["steps"].get("exactness") or {}).get("result") or {}
    if not ex.get("rows"):
        return []
    lines = [
        "",
        "## Exactness apart from numerics (random weights, peaked head)",
        "",
        "| dtype | verify-decode max abs diff | argmax agreement | logit std | min top-1 margin "
        "| margins <= diff | SD / SSD greedy mismatches (of tokens) | GoF T=1 n | GoF vs f64 reference: "
        "min p, passed | GoF vs own dtype: min p, passed | biased control (TV): min p, rejected |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ex["rows"]:
        g, o, c = r["gof"], r["gof_own_dtype"], r["control"]
        lines.append(
            f"| {r['dtype']} | {_fmt(r['max_abs_diff'])} | {_fmt(r['argmax_agreement'])} "
            f"| {_fmt(r['logit_std'])} | {_fmt(r['min_top1_margin'])} | {r['margins_below_diff']} "
            f"of {r['margin_positions']} | {r['sd_mismatches']} / {r['ssd_mismatches']} "
            f"({r['greedy_tokens']}) | {g['n']} | {_fmt(g['min_p'])}, {g['passed']} "
            f"| {_fmt(o['min_p'])}, {o['passed']} | ({c['tv']}) {_fmt(c['min_p'])}, {not c['passed']} |"
        )
    lines += [
        "",
        "Numerics: the target's logits for K + 1 tokens scored in one forward (a verify) against the "
        "same positions decoded one at a time; a margin within that difference is where rounding can "
        "flip a greedy choice. Exactness: greedy SD / SSD tokens against greedy AR, and SD's T = 1 "
        "emissions against the target's distribution (tests/reference.py: randomised-PIT chi-square "
        f"and KS, pooled and per round offset, Bonferroni at alpha {ex['rows'][0]['gof']['alpha']:g}), "
        "computed by the float64 numpy reference from the same weights and by the model itself in its "
        "own dtype (in bfloat16 only the latter is free of rounding); the control redraws the same "
        "tokens at the stated total-variation distance (mass moved off the top token) and must be "
        "rejected.",
    ]
    return lines


def render_cmdbuf(res: dict) -> list[str]:
    """AR decode tok/s with XLA's default flags and with command buffers (CUDA graphs) off."""
    cb = (res["steps"].get("cmdbuf") or {}).get("result") or {}
    if not cb.get("variants"):
        return []
    lines = [
        "",
        f"## AR decode with and without XLA's command buffers (`{cb['flag']}`)",
        "",
        "| run | model | best decode tok/s | all repeats | first call s |",
        "|---|---|---|---|---|",
    ]
    for name, v in cb["variants"].items():
        for r in v.get("rows", []):
            tps = r["decode_tok_s"]
            lines.append(
                f"| {name} | {r['model']} | {max(tps):.1f} | {', '.join(f'{x:.1f}' for x in tps)} "
                f"| {r['first_call_s']:.1f} |"
            )
    if cb.get("note"):
        lines += ["", cb["note"] + "."]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: the same code path in seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "experiments" / "results" / "gpu"))
    ap.add_argument(
        "--work", default=None, help="where the model folders go (default: a temp dir; not under --out)"
    )
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated steps to run, the others recorded as skipped (e.g. the test suite's short smoke)",
    )
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
        os.environ["XLA_FLAGS"] = smoke_xla_flags()
    steps = {}
    only = None if a.only is None else {x.strip() for x in a.only.split(",") if x.strip()}
    if only is not None and not only <= set(cfg["limits"]):
        raise SystemExit(f"error: --only {a.only}: steps are {', '.join(cfg['limits'])}")
    with open(out / "gpu_check.log", "w") as log:
        for name, limit in cfg["limits"].items():
            if only is not None and name not in only:
                steps[name] = {"status": "skipped: not in --only", "seconds": 0.0}
                continue
            left = a.budget_s - (time.perf_counter() - t0)
            if left < max(10.0, OPTIONAL.get(name, 0.0)):
                steps[name] = {"status": "skipped: budget spent", "seconds": 0.0}
                continue
            if name in NEEDS_BUILD and steps.get("build", {}).get("status") != "ok":
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
    skipped = lambda k, s: (
        (k in OPTIONAL and s["status"].startswith("skipped")) or s["status"].endswith("--only")
    )  # noqa: E731
    return 0 if all(s["status"] == "ok" or skipped(k, s) for k, s in steps.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
