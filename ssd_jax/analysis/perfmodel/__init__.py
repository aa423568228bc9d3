"""Performance model for AR, SD and SSD decoding on large hardware, validated on this CPU.

Everything here is plain Python / numpy arithmetic on a handful of constants; nothing is
traced or compiled by JAX (except :func:`measure_forward`, which times real forward passes
of synthetic-weight models and imports JAX lazily). Equations (docs/reference.md §2, §6, §8):

One forward pass
----------------
A model with ``W`` weight bytes read per step (``params.weight_bytes_per_token``), ``N``
weight-multiplying parameters (the same count, in parameters), run on ``tp`` tensor-parallel
devices over ``M = b·T`` tokens (``b`` rows, ``T`` new tokens per row) at context ``L``::

    t_mem  = (W + b·L·kv_bytes_per_token) / tp / (BW · bw_eff)
    t_cmp  = [2·N·(M + m_half·[M > 1]) + 4·M·L·layers·heads·head_dim] / tp / (FLOPS · flop_eff)
    t_comm = 2·layers · (link_latency + 2(tp−1)/tp · M·hidden·itemsize / link_BW)   (tp > 1)
    t_fwd  = step_overhead + max(t_mem, t_cmp) + t_comm

``m_half`` is Hockney's half-performance length for the GEMM path: a forward with more than
one token per step goes through a matrix-matrix product whose efficiency at small ``M`` is
``M / (M + m_half)``. On XLA:CPU a 1-token step is a matrix-vector product at the bandwidth
bound, while 2..8 tokens take the GEMM path and cost 2–2.5× as much (the "small-M
inefficiency"); on GPUs ``m_half`` ≈ 0 and small-M steps stay memory bound.

Per round (``s_logit``: sampling cost per position per vocabulary entry, ``host``: fixed
host cost per round: dispatch, synchronisation, scheduling)::

    AR   t = t_fwd(target, M=b) + host + s_logit·V·b                            tokens/round = 1
    SD   t = draft + t_fwd(target, M=b(K+1)) + host + s_logit·V·b(K+1)          tokens/round = E[τ]
         draft = K steps of t_fwd(draft, M=b) + s_logit·V·b; the first step takes 2 tokens
                 per row (catch-up) with probability P(some row accepted all K)
         E[τ] = (1 − α^(K+1)) / (1 − α)  (i.i.d. acceptance), or the measured tokens/round
    SSD  unit u = t_fwd(target, M=b(K+1)) + host + s_logit·V·b(K+1) + handoff
         build   = t_fwd(draft, M=b(K+1)) + K · t_fwd(draft, M=b·B/d) (+ sampling), B = Σ F_k
                   branches per row sharded over d draft devices
         backup  = K draft steps (neural) or ~0 (fast / n-gram)
         Theorem 7 / Corollary 16 (``analysis.speedup.predicted_speedup``):
         S = [p·E_hit + (1−p)·E_miss] / [p^b·max(1, T_p) + (1 − p^b)·(1 + T_b)],
         T_p = build/u, T_b = backup/u, tokens/s per sequence = S / u.
         When the draft shares the target's compute (one device, or CPU "devices" that share
         the same cores) nothing can hide: the build is serialised, u' = u + build, T_p = 0.

Per-device numbers divide the throughput ``b · tokens/s`` by all devices used (SSD's extra
draft devices included).

Modules
-------
``shapes`` (model sizes), ``hardware`` (presets), ``roofline`` (one forward pass, one round
per method), ``calibrate`` (fitting and validation against results files), ``scenarios``
(the SSD paper's setting, our Qwen pair on an H200), ``measure`` (timing forward passes for
the GPU check), ``render`` (markdown tables, the generated blocks of
``docs/performance.md``). The CLI is ``python -m ssd_jax.perfmodel``
(:mod:`ssd_jax.cli.perfmodel`). This package face re-exports the public names.

Calibration and validation
--------------------------
:func:`fit_forward` fits ``step_overhead`` and ``bw_eff`` on 1-token forward times of
several models (least squares), then ``m_half`` (and ``flop_eff`` when at least two
distinct compute-side token counts are present) on multi-token forward times.
:func:`validate` does this on a stated subset of the CPU results (AR step times from the
AR suite; the n-gram SD rows, whose draft costs ~nothing, for the verify forward of K+1
tokens, the per-position sampling cost and the host overhead), then PREDICTS every AR, SD
and SSD decode tok/s in the results from those constants plus the measured acceptance and
cache-hit rates, and reports predicted against measured.
"""

from ssd_jax.analysis.perfmodel.calibrate import (
    QUIET_LOAD,
    ForwardSample,
    calibrate_forward,
    calibrate_from_results,
    fit_forward,
    forward_samples,
    load_results,
    predict_row,
    validate,
)
from ssd_jax.analysis.perfmodel.hardware import HARDWARE, Hardware, get_hardware, hardware_for_device
from ssd_jax.analysis.perfmodel.measure import measure_forward
from ssd_jax.analysis.perfmodel.render import (
    jsonable,
    render_forward_fit,
    render_hardware,
    render_paper,
    render_qwen,
    render_validation,
    update_doc,
)
from ssd_jax.analysis.perfmodel.roofline import (
    ForwardTime,
    Prediction,
    alpha_for_tokens,
    fits,
    forward_time,
    predict_ar,
    predict_sd,
    predict_ssd,
    sample_time,
)
from ssd_jax.analysis.perfmodel.scenarios import (
    PAPER,
    PAPER_P_HIT,
    PAPER_REPRO,
    PAPER_TOKENS_PER_STEP,
    paper_sensitivity,
    predict_paper,
    predict_qwen,
)
from ssd_jax.analysis.perfmodel.shapes import MODEL_CONFIGS, ModelShape, model_shape
from ssd_jax.analysis.sdsl import expected_tokens

__all__ = [
    "HARDWARE",
    "MODEL_CONFIGS",
    "PAPER",
    "PAPER_P_HIT",
    "PAPER_REPRO",
    "PAPER_TOKENS_PER_STEP",
    "QUIET_LOAD",
    "ForwardSample",
    "ForwardTime",
    "Hardware",
    "ModelShape",
    "Prediction",
    "alpha_for_tokens",
    "calibrate_forward",
    "calibrate_from_results",
    "expected_tokens",
    "fit_forward",
    "fits",
    "forward_samples",
    "forward_time",
    "get_hardware",
    "hardware_for_device",
    "jsonable",
    "load_results",
    "measure_forward",
    "model_shape",
    "paper_sensitivity",
    "predict_ar",
    "predict_paper",
    "predict_qwen",
    "predict_row",
    "predict_sd",
    "predict_ssd",
    "render_forward_fit",
    "render_hardware",
    "render_paper",
    "render_qwen",
    "render_validation",
    "sample_time",
    "update_doc",
    "validate",
]
