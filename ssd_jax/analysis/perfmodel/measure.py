"""Timing real forward passes of synthetic-weight models (the GPU check's measurements)."""

from __future__ import annotations

import logging
import json
import statistics
from pathlib import Path

from ssd_jax.analysis.perfmodel.shapes import MODEL_CONFIGS
from ssd_jax.models.config import ModelConfig

log = logging.getLogger(__name__)


def measure_forward(
    names: list[str],
    *,
    dtype: str = "bfloat16",
    shapes=((1, 1), (1, 5), (1, 2048), (1, 512), (16, 1), (4, 5)),
    context: int = 128,
    repeats: int = 10,
    out: str | None = None,
    configs: dict[str, ModelConfig] | None = None,
) -> dict:
    """Time jitted forward passes (logits included) of synthetic-weight models on the default device.

    Weights are constants (timing does not depend on their values), so no checkpoint is
    needed. Shapes ``(b, T)`` run in order, every model per shape, most useful first: 1-token
    steps (overhead and bandwidth), the verify shape, two long compute-bound passes (GEMM
    efficiency), then batched shapes. Rows are written to ``out`` after every measurement,
    so a timeout keeps what ran.
    """
    import jax

    configs = configs or MODEL_CONFIGS
    dev = jax.devices()[0]
    res = {
        "suite": "forward",
        "env": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device_kind": dev.device_kind,
            "dtype": dtype,
        },
        "rows": [],
    }
    params = {name: _synthetic_params(configs[name].replace(dtype=dtype)) for name in names}
    for b, T in shapes:
        for name in names:
            cfg, p = params[name]
            ts, comp = _time_forward(cfg, p, b, T, context, repeats)
            res["rows"].append(
                {
                    "model": name,
                    "config": cfg.to_dict(),
                    "batch": b,
                    "tokens": T,
                    "context": context,
                    "seconds": float(statistics.median(ts)),
                    "seconds_all": ts,
                    "compile_s": comp,
                }
            )
            log.info(
                f"{name} b={b} T={T}: {float(statistics.median(ts)) * 1e3:.3f} ms (compile {comp:.1f} s)"
            )
            if out:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(res, indent=1))
    return res


def _synthetic_params(cfg: ModelConfig):
    """(cfg, params) of a model of ``cfg`` with constant weights: norms 1, everything else 0.01."""
    import jax.numpy as jnp

    from ssd_jax.models.params import param_specs, unflatten

    flat = {
        k: jnp.full(shape, 1.0 if k.endswith("norm") else 0.01, cfg.jnp_dtype)
        for k, (shape, _) in param_specs(cfg).items()
    }
    return cfg, unflatten(cfg, flat)


def _time_forward(
    cfg: ModelConfig, p, b: int, T: int, context: int, repeats: int
) -> tuple[list[float], float]:
    """One jitted forward pass of ``T`` tokens (logits included) over ``b`` rows after ``context`` cached
    ones: (the seconds of each of ``repeats`` timed runs, the first run's (compilation included))."""
    import time

    import jax
    import jax.numpy as jnp

    from ssd_jax.models import llama

    def fwd(p, cache, toks):
        h, _ = llama.forward(p, cfg, toks, cache)
        return llama.logits(p, cfg, h)  # every position, as a verify pass computes them

    f = jax.jit(fwd)
    cache = llama.init_cache(cfg, b, context + T)
    cache = cache.with_lengths(jnp.full((b,), context, jnp.int32))
    toks = jnp.zeros((b, T), jnp.int32)
    t0 = time.perf_counter()
    f(p, cache, toks).block_until_ready()
    comp = time.perf_counter() - t0
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(p, cache, toks).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return ts, comp
