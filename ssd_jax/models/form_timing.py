"""Matmul forms chosen by measurement on this machine (issue 54).

The shipped table (``forms_cpu.json``) was measured on one machine; on another instruction set the
same choice can lose: on an AVX2-only CPU the older kernel cost 5x a one-row product at 5 rows and
lost to XLA's dot at every row count. So on CPU, at a model's first load, :func:`refine` times the
forms that store W as the checkpoint does (``right``: XLA's ``x @ W.T``; ``left``: XLA's
``(W @ x.T).T``; ``kernel``: the project's kernel) per matrix role and row bucket at the model's own
shapes and keeps the fastest: the decode bucket at M = 1, the verify bucket summed over
:data:`VERIFY_ROWS`. Prefill keeps the table's form. The table is only the prior: it stays where the
measurement does not apply (matrices under :data:`MIN_BYTES`, whose cost is nil; weights stored
narrower than the activations, which always take the kernel: ``forms.contract``; no kernel here).

Each measurement is cached in ``<cache>/forms/`` keyed by the kernels' build id (sources, compiler,
flags, CPU), jax's version, ``XLA_FLAGS``, the shape and the dtype, written atomically under a file
lock (two processes loading the same model measure once). ``SSD_JAX_FORMS=table`` skips it.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

#: the verify bucket's row counts timed (a K = 1, 4 and 7 round at batch 1); their times are summed
VERIFY_ROWS = (2, 5, 8)
#: the forms timed (all read W as the checkpoint stores it)
CANDIDATES = ("right", "left", "kernel")
#: matrices smaller than this keep the table's form (their products cost about nothing either way)
MIN_BYTES = 256 * 1024
#: the weights timed: copies of the matrix up to this many bytes, so they stream from memory as in a model
STREAM_BYTES = 64 * 1024 * 1024
REPEATS = 5


def cache_dir() -> Path:
    from ssd_jax.compile import user_cache

    return user_cache() / "forms"


def _key(shape: tuple[int, int], dtype: str) -> str:
    import jax

    from ssd_jax.compile import cpu_tag
    from ssd_jax.models import kernels

    h = hashlib.sha256()
    for part in (
        kernels.build_id(),
        jax.__version__,
        os.environ.get("XLA_FLAGS", ""),
        cpu_tag(),
        f"{shape[0]}x{shape[1]}",
        dtype,
        ",".join(CANDIDATES),
        ",".join(map(str, VERIFY_ROWS)),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def time_forms(shape: tuple[int, int], dtype: str = "float32", repeats: int = REPEATS) -> dict[str, Any]:
    """Median seconds per call of each candidate form at M = 1 and at :data:`VERIFY_ROWS` rows for a W of
    ``shape`` (out, in), the candidates interleaved call by call: ``{"rows": {M: {form: s}}}``."""
    import jax
    import jax.numpy as jnp

    from ssd_jax.models import forms as F
    from ssd_jax.models import kernels

    n, k = shape
    itemsize = jnp.dtype(dtype).itemsize
    copies = int(max(1, min(16, STREAM_BYTES // (n * k * itemsize))))
    ws = [jnp.full((n, k), 0.01 * (i + 1), dtype) for i in range(copies)]
    cands = [c for c in CANDIDATES if c != "kernel" or kernels.available()]
    rows = (1, *VERIFY_ROWS)
    xs = {m: jnp.full((m, k), 0.5, dtype) for m in rows}
    fns = {}
    for c in cands:

        def run(x, ws, c=c):  # one output per copy: XLA may not fuse the copies' products
            return [F.contract(x, w, "oi", c) for w in ws]

        fns[c] = jax.jit(run)
    for m in rows:
        for f in fns.values():
            jax.block_until_ready(f(xs[m], ws))
    times: dict[int, dict[str, list[float]]] = {m: {c: [] for c in cands} for m in rows}
    for _ in range(repeats):
        for m in rows:
            for c, f in fns.items():
                t = time.perf_counter()
                jax.block_until_ready(f(xs[m], ws))
                times[m][c].append((time.perf_counter() - t) / copies)
    return {
        "shape": [n, k],
        "dtype": dtype,
        "copies": copies,
        "repeats": repeats,
        "rows": {str(m): {c: statistics.median(v) for c, v in times[m].items()} for m in rows},
        "kernels": kernels.isa(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


#: another form replaces XLA's own dot (``right``) only where it is faster by more than this fraction (the
#: timing's noise: a tie keeps XLA's dot)
MARGIN = 0.03


def _fastest(cost: dict[str, float]) -> str:
    best = min(cost, key=cost.get)
    if "right" in cost and cost[best] > cost["right"] * (1 - MARGIN):
        return "right"
    return best


def choose(timed: dict[str, Any]) -> tuple[str, str]:
    """The fastest form for the decode bucket (M = 1) and for the verify bucket (summed over its rows);
    XLA's dot unless another form beats it by more than :data:`MARGIN`."""
    rows = timed["rows"]
    verify_cost = {c: sum(rows[str(m)][c] for m in VERIFY_ROWS) for c in rows["1"]}
    return _fastest(rows["1"]), _fastest(verify_cost)


def measured(shape: tuple[int, int], dtype: str = "float32", timer=time_forms) -> dict[str, Any]:
    """:func:`time_forms` for ``shape``, from the cache when this machine and build measured it before."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{_key(shape, dtype)}.json"
    with open(d / ".lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be measuring (and would skew this one)
        except ImportError:
            pass
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        timed = timer(shape, dtype)
        fd, tmp = tempfile.mkstemp(prefix=".forms-", dir=d)
        with os.fdopen(fd, "w") as f:
            json.dump(timed, f)
        os.replace(tmp, path)
        return timed


def resolve(cfg, forms=None):
    """The loader's forms: :func:`ssd_jax.models.forms.resolve`, refined by :func:`refine` where that gives
    the CPU table for "auto" (the default)."""
    import jax

    from ssd_jax.models import forms as F

    got = F.resolve(cfg, forms)
    if isinstance(forms, F.Forms) or jax.default_backend() != "cpu":
        return got
    return refine(cfg, got) if (forms or os.environ.get("SSD_JAX_FORMS") or "auto") == "auto" else got


def refine(cfg, prior, timer=time_forms):
    """``prior`` (the table's :class:`~ssd_jax.models.forms.Forms` for ``cfg``) with each role's decode and
    verify orders replaced by the measured fastest where the measurement applies (module docstring)."""
    import dataclasses

    from ssd_jax.models import forms as F
    from ssd_jax.models import kernels

    if os.environ.get("SSD_JAX_FORMS") == "table" or cfg.dtype != "float32" or not kernels.available():
        return prior
    if (cfg.weight_dtype or cfg.dtype) != "float32":
        return prior  # narrow weights go to the kernel at any order (forms.contract)
    picked = {}
    for trole, shape in F.table_shapes(cfg).items():
        if shape[0] * shape[1] * 4 < MIN_BYTES:
            continue
        decode, verify = choose(measured(tuple(shape), "float32", timer))
        for role in F.TABLE_ROLES[trole]:
            old = getattr(prior, role)
            if old.layout != "oi":  # the candidates read W stored (out, in) only
                continue
            picked[role] = F.Form("oi", (decode, verify, old.orders[2]))
    return dataclasses.replace(prior, **picked)


def describe(forms) -> str:
    """A short account of the forms for the plan line: ``decode right; verify kernel (q/o k/v ...)``."""
    from ssd_jax.models import forms as F
    from ssd_jax.models import kernels

    parts = []
    for bucket, i in (("decode", 0), ("verify", 1)):
        by: dict[str, list[str]] = {}
        for trole, roles in F.TABLE_ROLES.items():
            order = getattr(forms, roles[0]).orders[i]
            if order == "kernel" and not kernels.available():
                order = "right"  # what runs: forms.contract falls back to XLA's dot
            by.setdefault(order, []).append(trole)
        parts.append(f"{bucket} " + ", ".join(f"{o} ({' '.join(r)})" for o, r in by.items()))
    return "; ".join(parts)
