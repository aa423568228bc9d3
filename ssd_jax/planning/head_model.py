"""The round model of SD with an EAGLE-style head (:mod:`ssd_jax.drafters.eagle`), and its K.

A head's acceptance is not geometric: its first proposal reads the target's features, the later ones
its own fed-back outputs, and those are weaker. So K comes from the head's own curve instead of one α::

    S(K) = (1 + sum_{d <= K} P_d) · t_ar / (K · t_head + t_verify(K + 1)),   K in 1..8

* ``P_d``: P(the first d proposals are all accepted), measured at the end of the head's training on
  held-out prompts (teacher-forced, greedy) and stored in its file (``acceptance_by_position``). Beyond
  the curve's last position it falls by the curve's last ratio.
* ``t_ar``, ``t_verify``: the target's decode step and verify forward, timed as for a draft model's K
  auto (:func:`ssd_jax.planning.calibration.target_part`) and cached the same way
  (:meth:`ssd_jax.planning.records.Calibrator.target_costs`).
* ``t_head``: one draft step, priced as ``t_ar`` times the bytes of weight matrices it reads (its layer,
  input maps and the LM head rows it keeps) over the target's: decode at small batches reads weights.

A head without a stored curve (one trained before the curve was written) gets ``DEFAULT_K``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ssd_jax.decoding.spec import K_MAX
from ssd_jax.planning.records import Calibrator
from ssd_jax.planning.sd_model import best_k, interpolate_verify

DEFAULT_K = 4


def head_curve(curve: Sequence[float], k_max: int = K_MAX) -> list[float]:
    """``P_d`` for d = 1..k_max from a measured curve, extended by its last ratio."""
    p = [min(max(float(x), 0.0), 1.0) for x in curve]
    if not p:
        raise ValueError("empty acceptance curve")
    r = p[-1] / p[-2] if len(p) > 1 and p[-2] > 0 else p[-1]
    while len(p) < k_max:
        p.append(p[-1] * min(r, 1.0))
    return p[:k_max]


def head_speedups(curve: Sequence[float], t_ar: float, t_verify: dict, t_head: float) -> dict[int, float]:
    """S(K) for K = 1..K_MAX (``t_verify`` keyed by K, as :func:`interpolate_verify` gives it)."""
    p = head_curve(curve)
    return {k: float((1.0 + sum(p[:k])) * t_ar / (k * t_head + t_verify[k])) for k in range(1, K_MAX + 1)}


def _matrix_bytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim >= 2))


def head_step_bytes(model, head: dict) -> int:
    """Bytes of weight matrices one head step reads: its own, plus the LM head rows it keeps."""
    own = _matrix_bytes({k: v for k, v in head.items() if k not in ("vocab_ids", "lm_rows")})
    cfg = model.cfg
    n = int(np.asarray(head["vocab_ids"]).shape[0]) if "vocab_ids" in head else cfg.vocab_size
    itemsize = np.dtype(model.params["embed"].dtype).itemsize
    return own + n * cfg.hidden_size * itemsize


def choose_head_k(model, head: dict, meta: dict, batch: int) -> tuple[int, dict]:
    """(K, info) for SD with ``head`` at ``batch`` rows."""
    curve = meta.get("acceptance_by_position")
    if not curve:
        return DEFAULT_K, {"source": "default (the head stores no acceptance curve)"}
    t0 = time.perf_counter()
    cal = Calibrator(model).target_costs(batch)
    t_ar = float(cal.costs.t_ar)
    t_head = t_ar * head_step_bytes(model, head) / max(_matrix_bytes(model.params), 1)
    sp = head_speedups(curve, t_ar, interpolate_verify(cal.costs.t_verify), t_head)
    k = best_k(sp)
    return k, {
        "source": cal.source,
        "t_ar": t_ar,
        "t_head": t_head,
        "acceptance_by_position": list(curve),
        "expected_speedup_by_k": {str(i): round(s, 4) for i, s in sp.items()},
        "calibration_s": time.perf_counter() - t0 if cal.source == "measured" else 0.0,
        "cache_file": str(cal.path),
    }
