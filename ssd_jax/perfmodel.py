"""Performance model for AR, SD and SSD decoding on large hardware, validated on this CPU.

Everything here is plain Python / numpy arithmetic on a handful of constants; nothing is
traced or compiled by JAX (except :func:`measure_forward`, which times real forward passes
of synthetic-weight models and imports JAX lazily). Equations (REFERENCE.md §1, §2, §4):

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
         Theorem 7 / Corollary 16 (``fanout.predicted_speedup``):
         S = [p·E_hit + (1−p)·E_miss] / [p^b·max(1, T_p) + (1 − p^b)·(1 + T_b)],
         T_p = build/u, T_b = backup/u, tokens/s per sequence = S / u.
         When the draft shares the target's compute (one device, or CPU "devices" that share
         the same cores) nothing can hide: the build is serialised, u' = u + build, T_p = 0.

Per-device numbers divide the throughput ``b · tokens/s`` by all devices used (SSD's extra
draft devices included).

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

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.fanout import predicted_speedup
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import count_params, weight_bytes_per_token

# --- hardware -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator (or this CPU) as the model sees it.

    Attributes:
      name: label.
      hbm_gb_s: peak memory bandwidth per device, GB/s (1e9 bytes).
      peak_tflops: dense peak per device (bf16 on accelerators, f32 on the CPU), TFLOP/s.
      memory_gb: memory capacity per device (for the "does it fit" check).
      step_overhead_s: fixed cost of one forward pass (kernel launches / dispatch).
      host_overhead_s: fixed host cost per decode round (sync, scheduling, bookkeeping).
      link_gb_s: interconnect bandwidth per device and direction (tensor-parallel all-reduce).
      link_latency_s: latency of one small all-reduce or point-to-point hop.
      bw_eff: achieved fraction of ``hbm_gb_s`` when streaming weights.
      flop_eff: achieved fraction of ``peak_tflops`` in large GEMMs.
      m_half: half-performance token count of the multi-token (GEMM) path; 0 = none.
      sample_s_per_logit: sampling / softmax cost per position and vocabulary entry.
      bytes_per_param: weight and KV itemsize (2 = bf16, 4 = f32).
      shared_draft: the draft "devices" share the target's compute (the CPU's virtual
        devices): SSD cannot hide the cache build.
      source: where the numbers come from.
    """

    name: str
    hbm_gb_s: float
    peak_tflops: float
    memory_gb: float
    step_overhead_s: float
    host_overhead_s: float
    link_gb_s: float
    link_latency_s: float
    bw_eff: float = 0.85
    flop_eff: float = 0.75
    m_half: float = 0.0
    sample_s_per_logit: float = 2e-11
    bytes_per_param: int = 2
    shared_draft: bool = False
    source: str = ""

    def replace(self, **kw) -> Hardware:
        return dataclasses.replace(self, **kw)

    @property
    def bw(self) -> float:
        """Achieved bytes/s."""
        return self.hbm_gb_s * 1e9 * self.bw_eff

    @property
    def flops(self) -> float:
        """Achieved FLOP/s in large GEMMs."""
        return self.peak_tflops * 1e12 * self.flop_eff


def _llama_8b() -> ModelConfig:
    return ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128)


# The vLLM study's H100 latency model (REFERENCE §4, Llama-3.1-8B): a target forward costs
# 5.9 ms + 21 µs per batched token; per-step host overhead 1.2 ms. With an assumed 85% of
# the 3.35 TB/s spec for the weight stream, the part of the 5.9 ms that the 16 GB of bf16
# weights do not explain is the per-forward launch cost; 21 µs per token of 2·N FLOPs gives
# the achieved GEMM fraction.
_H100_BW_EFF = 0.85
_VLLM_8B_FWD_S, _VLLM_8B_PER_TOKEN_S, _VLLM_HOST_S = 5.9e-3, 21e-6, 1.2e-3
_H100_STEP_S = _VLLM_8B_FWD_S - weight_bytes_per_token(_llama_8b(), 2) / (3350e9 * _H100_BW_EFF)
_H100_FLOP_EFF = 2 * weight_bytes_per_token(_llama_8b(), 1) / _VLLM_8B_PER_TOKEN_S / 989e12
_GPU_NOTE = (f"bw_eff {_H100_BW_EFF} assumed; step overhead {_H100_STEP_S * 1e3:.2f} ms and flop_eff "
             f"{_H100_FLOP_EFF:.2f} derived from the vLLM study's H100 latency model (REFERENCE §4); host "
             f"{_VLLM_HOST_S * 1e3:.1f} ms per round from the same study; all-reduce latency 10 µs assumed")

HARDWARE: dict[str, Hardware] = {
    "h100-sxm": Hardware("H100-SXM", 3350, 989, 80, _H100_STEP_S, _VLLM_HOST_S, 450, 10e-6, _H100_BW_EFF,
                         _H100_FLOP_EFF, source="spec sheet (HBM3 3.35 TB/s, 989 TFLOP/s bf16 dense, NVLink4 "
                         "900 GB/s both ways); " + _GPU_NOTE),
    "h200": Hardware("H200", 4800, 989, 141, _H100_STEP_S, _VLLM_HOST_S, 450, 10e-6, _H100_BW_EFF, _H100_FLOP_EFF,
                     source="spec sheet (HBM3e 4.8 TB/s, same compute as H100); efficiencies and overheads as "
                     "H100 until experiments/gpu_check.sh measures them"),
    "a100-80gb": Hardware("A100-80GB", 2039, 312, 80, _H100_STEP_S, _VLLM_HOST_S, 300, 10e-6, _H100_BW_EFF,
                          _H100_FLOP_EFF, source="spec sheet (HBM2e 2.04 TB/s, 312 TFLOP/s bf16, NVLink3 600 GB/s "
                          "both ways); efficiencies and overheads as H100 (assumed)"),
    "tpu-v5e": Hardware("TPU v5e", 819, 197, 16, _H100_STEP_S, _VLLM_HOST_S, 100, 10e-6, _H100_BW_EFF, 0.6,
                        source="spec sheet (819 GB/s HBM2, 197 TFLOP/s bf16, 16 GB, ICI 1600 Gbps); flop_eff 0.6, "
                        "overheads as H100 (assumed)"),
    # this development CPU: bandwidth measured by the AR suite (experiments/results/ar_cpu.json);
    # peak = 2 vCPU x 2.45 GHz x 32 f32 FLOP/cycle (AVX2, two FMA pipes), assumed. The efficiency
    # and overhead values are priors: validate() refits them on the measured results.
    "cpu": Hardware("this CPU (2 cores, f32)", 21.6, 0.157, 24, 5e-3, 1e-3, 1e3, 0.0, 0.9, 0.6, m_half=18.0,
                    sample_s_per_logit=2e-8, bytes_per_param=4, shared_draft=True,
                    source="bandwidth 21.6 GB/s measured (ar_cpu.json); peak f32 157 GFLOP/s assumed; flop_eff "
                    "0.6 assumed; other constants fitted by validate()"),
}


def hardware_for_device(platform: str, device_kind: str = "", itemsize: int = 4) -> Hardware:
    """The table entry closest to a JAX device (``device.platform``, ``device.device_kind``).

    A static guess, never a measurement: the SSD engine uses it for decisions that must not
    depend on wall-clock timings (the ``auto`` backup), so a seeded run is reproducible.
    """
    kind = device_kind.lower()
    if platform == "gpu":
        name = "h200" if "h200" in kind else "a100-80gb" if "a100" in kind else "h100-sxm"
    elif platform == "tpu":
        name = "tpu-v5e"
    else:
        name = "cpu"
    return HARDWARE[name].replace(bytes_per_param=itemsize)


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise SystemExit(f"unknown hardware {name!r} (choose from {', '.join(HARDWARE)})") from None


# --- models ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the time model needs to know about a decoder: sizes, not weights."""

    name: str
    params: int  # all parameters (count_params)
    weight_params: int  # parameters read (and multiplied) per decode step
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, name: str, cfg: ModelConfig) -> ModelShape:
        return cls(name, count_params(cfg), weight_bytes_per_token(cfg, 1), cfg.num_layers, cfg.hidden_size,
                   cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)

    def weight_bytes(self, itemsize: int) -> float:
        return float(self.weight_params) * itemsize

    def kv_bytes_per_token(self, itemsize: int) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * itemsize


MODEL_CONFIGS: dict[str, ModelConfig] = {
    # as loaded by ssd_jax (the GGUFs carry a separate output head); parameter counts match
    # experiments/results/ar_cpu.json
    "qwen2.5-coder-1.5b-instruct": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536,
                                               intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                                               head_dim=128, qkv_bias=True),
    "qwen2.5-coder-0.5b-instruct": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=896,
                                               intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                                               head_dim=64, qkv_bias=True),
    "smollm2-135m-instruct": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                         num_heads=9, num_kv_heads=3, head_dim=64, tie_embeddings=True),
    # the SSD paper's pair (published configs)
    "llama-3.1-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                                 num_heads=64, num_kv_heads=8, head_dim=128),
    "llama-3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64, tie_embeddings=True),
    "llama-3.1-8b": _llama_8b(),
}


def model_shape(name: str) -> ModelShape:
    """A preset, ``<target>-first-N-layers`` (a truncated target), or a draft checkpoint directory."""
    if name in MODEL_CONFIGS:
        return ModelShape.from_config(name, MODEL_CONFIGS[name])
    if "-first-" in name and name.endswith("-layers"):
        base, n = name.rsplit("-first-", 1)
        if base in MODEL_CONFIGS:
            return ModelShape.from_config(name, MODEL_CONFIGS[base].replace(num_layers=int(n.split("-")[0])))
    for d in (Path(name), Path("checkpoints") / name):
        for f in ("draft.json", "config.json"):
            if (d / f).is_file():
                cfg = json.loads((d / f).read_text())
                return ModelShape.from_config(name, ModelConfig.from_dict(cfg.get("config", cfg)))
    raise KeyError(f"unknown model {name!r}: add its config to MODEL_CONFIGS")


# --- one forward pass -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ForwardTime:
    total: float
    memory: float
    compute: float
    comm: float
    overhead: float

    @property
    def bound(self) -> str:
        return "compute" if self.compute > self.memory else "memory"


def forward_time(hw: Hardware, m: ModelShape, *, batch: int = 1, tokens: int = 1, context: float = 0.0,
                 tp: int = 1) -> ForwardTime:
    """Seconds for one forward pass of ``batch`` rows x ``tokens`` new tokens at ``context``."""
    it = hw.bytes_per_param
    M = batch * tokens
    mem = (m.weight_bytes(it) + batch * context * m.kv_bytes_per_token(it)) / tp / hw.bw
    gemm = 2.0 * m.weight_params * (M + (hw.m_half if M > 1 else 0.0))
    attn = 4.0 * M * context * m.layers * m.heads * m.head_dim
    cmp_ = (gemm + attn) / tp / hw.flops
    comm = 0.0
    if tp > 1:
        msg = M * m.hidden * it
        comm = 2 * m.layers * (hw.link_latency_s + 2.0 * (tp - 1) / tp * msg / (hw.link_gb_s * 1e9))
    return ForwardTime(hw.step_overhead_s + max(mem, cmp_) + comm, mem, cmp_, comm, hw.step_overhead_s)


def sample_time(hw: Hardware, m: ModelShape, positions: float) -> float:
    return hw.sample_s_per_logit * m.vocab * positions


def fits(hw: Hardware, m: ModelShape, tp: int = 1) -> bool:
    return m.weight_bytes(hw.bytes_per_param) / tp <= hw.memory_gb * 1e9 * 0.9


# --- per-method predictions -------------------------------------------------------------------


@dataclasses.dataclass
class Prediction:
    method: str
    tokens_per_s: float  # per sequence
    batch: int
    devices: int
    tokens_per_round: float  # per sequence
    round_s: float
    parts: dict[str, float]  # seconds per round by component
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.tokens_per_s * self.batch

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.throughput / self.devices

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(throughput=self.throughput, tokens_per_s_per_device=self.tokens_per_s_per_device)
        return d


def expected_tokens(alpha: float, k: int) -> float:
    """E[τ] = (1 − α^(K+1)) / (1 − α): tokens per round with i.i.d. acceptance (bonus included)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_for_tokens(tau: float, k: int) -> float:
    """The i.i.d. acceptance α whose E[τ] at lookahead K is ``tau`` (bisection)."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tokens per round must be in [1, K+1], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if expected_tokens(mid, k) < tau else (lo, mid)
    return 0.5 * (lo + hi)


def predict_ar(hw: Hardware, target: ModelShape, *, batch: int = 1, context: float = 512, tp: int = 1) -> Prediction:
    fwd = forward_time(hw, target, batch=batch, tokens=1, context=context, tp=tp).total
    over = hw.host_overhead_s + sample_time(hw, target, batch)
    t = fwd + over
    return Prediction("ar", 1.0 / t, batch, tp, 1.0, t, {"verify": fwd, "overhead": over})


def _draft_chain(hw, draft, k, batch, context, p_catch_up, per_step_sync):
    """K autoregressive draft steps; the first feeds 2 tokens per row when catching up."""
    one = forward_time(hw, draft, batch=batch, tokens=1, context=context).total
    two = forward_time(hw, draft, batch=batch, tokens=2, context=context).total
    samp = sample_time(hw, draft, batch)
    sync = hw.host_overhead_s if per_step_sync else 0.0
    return p_catch_up * two + (1 - p_catch_up) * one + (k - 1) * one + k * (samp + sync)


def predict_sd(hw: Hardware, target: ModelShape, draft: ModelShape, *, k: int, alpha: float | None = None,
               tokens_per_round: float | None = None, p_catch_up: float | None = None, batch: int = 1,
               context: float = 512, tp: int = 1, draft_hw: Hardware | None = None,
               draft_loop: str = "fused") -> Prediction:
    """SD: K draft steps, then one verify of K+1 tokens. Give ``alpha`` or the measured ``tokens_per_round``.

    ``draft_loop``: "fused" (the K draft steps are one compiled program, as in ssd_jax) or
    "per_step" (a host round trip per draft step, as in engines that sample on the host).
    ``p_catch_up``: probability that the first draft step feeds two tokens per row (some row
    accepted all K last round); default from ``alpha``: 1 − (1 − α^K)^b.
    """
    if tokens_per_round is None:
        if alpha is None:
            raise ValueError("give alpha or tokens_per_round")
        tokens_per_round = expected_tokens(alpha, k)
    if p_catch_up is None:
        a = alpha if alpha is not None else alpha_for_tokens(tokens_per_round, k)
        p_catch_up = 1.0 - (1.0 - a**k) ** batch
    dhw = draft_hw or hw
    t_draft = _draft_chain(dhw, draft, k, batch, context, p_catch_up, draft_loop == "per_step")
    t_ver = forward_time(hw, target, batch=batch, tokens=k + 1, context=context, tp=tp).total
    over = hw.host_overhead_s + sample_time(hw, target, batch * (k + 1))
    t = t_draft + t_ver + over
    return Prediction("sd", tokens_per_round / t, batch, tp, tokens_per_round, t,
                      {"draft": t_draft, "verify": t_ver, "overhead": over},
                      {"k": k, "T_SD": t_draft / (t_ver + over), "draft_share": t_draft / t})


def predict_ssd(hw: Hardware, target: ModelShape, draft: ModelShape, *, k: int, fan_budget: int, p_hit: float,
                tau_hit: float, tau_miss: float, backup: str = "neural", batch: int = 1, context: float = 512,
                tp: int = 1, draft_devices: int = 1, shared: bool | None = None, draft_hw: Hardware | None = None,
                draft_loop: str = "fused", t_fast: float = 0.0) -> Prediction:
    """SSD by Theorem 7 / Corollary 16 (``fanout.predicted_speedup``) with modelled component times.

    ``fan_budget``: branches per row (Σ F_k); ``backup``: "neural" (K draft steps on a miss)
    or "fast" (n-gram / random, ``t_fast`` seconds). ``shared``: the draft runs on the
    target's compute, so the build is serialised (default: ``hw.shared_draft``).
    """
    shared = hw.shared_draft if shared is None else shared
    dhw = draft_hw or hw
    t_ver = forward_time(hw, target, batch=batch, tokens=k + 1, context=context, tp=tp).total
    handoff = 0.0 if shared else 2 * hw.link_latency_s
    over = hw.host_overhead_s + sample_time(hw, target, batch * (k + 1)) + handoff
    sync = dhw.host_overhead_s if draft_loop == "per_step" else 0.0
    per_dev = batch * fan_budget / max(1, draft_devices)
    rerun = (forward_time(dhw, draft, batch=batch, tokens=k + 1, context=context).total
             + sample_time(dhw, draft, batch * (k + 1)) + sync)
    branch = (forward_time(dhw, draft, batch=batch, tokens=max(1, round(per_dev / batch)), context=context).total
              + sample_time(dhw, draft, per_dev) + sync)
    build = rerun + k * branch
    if backup == "neural":
        t_b = _draft_chain(dhw, draft, k, batch, context, 0.0, draft_loop == "per_step")
    elif backup in ("fast", "ngram", "random"):
        t_b = t_fast
    else:
        raise ValueError(f"unknown backup {backup!r}")
    u = t_ver + over
    if shared:
        unit, T_p = u + build, 0.0
    else:
        unit, T_p = u, build / u
    T_b = t_b / unit
    S = predicted_speedup(p_hit, tau_hit, tau_miss, T_p, T_b, batch)
    tps = S / unit
    tokens = p_hit * tau_hit + (1 - p_hit) * tau_miss
    q = p_hit**batch
    exposed = (build if shared else q * max(0.0, build - u)) + (1 - q) * t_b
    devices = tp if shared else tp + draft_devices
    return Prediction("ssd", tps, batch, devices, tokens, tokens / tps,
                      {"verify": t_ver, "overhead": over, "build": build, "backup": t_b, "draft_exposed": exposed},
                      {"k": k, "T_p": T_p, "T_b": T_b, "unit_s": unit, "speedup_units": S, "shared": shared,
                       "build_hidden": (not shared) and build <= u})


# --- calibration ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ForwardSample:
    """A measured forward pass (seconds), for fitting."""

    model: ModelShape
    batch: int
    tokens: int
    context: float
    seconds: float
    source: str = ""


def fit_forward(hw: Hardware, samples: list[ForwardSample], *, fit_flops: bool = True) -> tuple[Hardware, dict]:
    """Fit the forward-time constants of ``hw`` to measured forward passes.

    1. 1-token samples: ``t = step_overhead + W/(BW·bw_eff)`` by least squares over models
       (with one model only ``bw_eff`` is fitted, the overhead kept).
    2. multi-token samples the memory term cannot explain (> 10% above it) are compute-side:
       ``(t − step_overhead)·FLOPS/(2N) = (x + m_half)/flop_eff`` with ``x = M + attention
       FLOPs/(2N)`` - a line in x; with two or more distinct token counts M it gives
       ``flop_eff`` and ``m_half``, with one only ``m_half`` (``flop_eff`` kept).
    Returns the fitted hardware and a report of what was fitted on what.
    """
    rep: dict[str, Any] = {"fitted": [], "kept": []}
    it = hw.bytes_per_param
    ones = [s for s in samples if s.batch * s.tokens == 1]
    multi = [s for s in samples if s.batch * s.tokens > 1]
    if ones:
        x = np.array([(s.model.weight_bytes(it) + s.context * s.model.kv_bytes_per_token(it)) / (hw.hbm_gb_s * 1e9)
                      for s in ones])
        y = np.array([s.seconds for s in ones])
        if len({s.model.name for s in ones}) >= 2:
            A = np.stack([np.ones_like(x), x], axis=1)
            (c, inv_eff), *_ = np.linalg.lstsq(A, y, rcond=None)
            if c < 0:
                c, inv_eff = 0.0, float(np.sum(x * y) / np.sum(x * x))
            hw = hw.replace(step_overhead_s=float(c), bw_eff=float(1.0 / inv_eff))
            rep["fitted"] += ["step_overhead_s", "bw_eff"]
        else:
            hw = hw.replace(bw_eff=float(np.mean(x / np.maximum(y - hw.step_overhead_s, 1e-12))))
            rep["fitted"] += ["bw_eff"]
            rep["kept"] += ["step_overhead_s"]
    comp = []
    for s in multi:
        f = forward_time(hw.replace(m_half=0.0), s.model, batch=s.batch, tokens=s.tokens, context=s.context)
        if s.seconds > 1.1 * (hw.step_overhead_s + f.memory):
            # (t - c)·FLOPS / 2N = (x + m_half) / flop_eff with x = M + attention FLOPs / 2N
            attn = 4.0 * s.batch * s.tokens * s.context * s.model.layers * s.model.heads * s.model.head_dim
            two_n = 2.0 * s.model.weight_params
            comp.append((s.batch * s.tokens + attn / two_n,
                         (s.seconds - hw.step_overhead_s) * hw.peak_tflops * 1e12 / two_n))
    rep["compute_side_samples"] = len(comp)
    if comp:
        Ms = np.array([c[0] for c in comp], float)
        ys = np.array([c[1] for c in comp])
        if fit_flops and len({round(m) for m in Ms.tolist()}) >= 2:
            slope, icpt = np.polyfit(Ms, ys, 1)  # y = x/eff + m_half/eff
            eff = 1.0 / slope
            hw = hw.replace(flop_eff=float(eff), m_half=float(max(0.0, icpt * eff)))
            rep["fitted"] += ["flop_eff", "m_half"]
        else:
            hw = hw.replace(m_half=float(max(0.0, np.mean(ys * hw.flop_eff - Ms))))
            rep["fitted"] += ["m_half"]
            rep["kept"] += ["flop_eff"]
    rep["residuals"] = [
        {"model": s.model.name, "batch": s.batch, "tokens": s.tokens, "measured_s": s.seconds,
         "predicted_s": forward_time(hw, s.model, batch=s.batch, tokens=s.tokens, context=s.context).total,
         "source": s.source}
        for s in samples
    ]
    return hw, rep


# --- results files --------------------------------------------------------------------------


def load_results(path: str | os.PathLike) -> dict:
    with open(path) as f:
        res = json.load(f)
    res["_path"] = str(path)
    return res


def _itemsize(row: dict, default: int) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(row.get("dtype", ""), default)


def _median(xs):
    return float(statistics.median(xs))


def _is_ngram(r: dict) -> bool:
    return str(r.get("draft", "")) == "ngram" or str(r.get("method", "")).startswith("ngram")


def calibrate_from_results(results: list[dict], hw: Hardware) -> tuple[Hardware, dict]:
    """Fit the CPU constants on a stated subset of the results (see :func:`validate`).

    * host overhead per round, sampling cost per logit and the verify forward of K+1 tokens:
      the batch-1 n-gram SD rows (their draft is a host lookup costing ~1 ms per round), or,
      when no n-gram rows are given, the verify components of the batch-1 SD rows;
    * step overhead and bandwidth efficiency: the AR suite's 1-token step times (median of
      the repeats) of every model, minus the host and sampling cost just fitted.
    """
    report: dict[str, Any] = {}
    comp_rows, comp_src = [], ""
    for res in results:
        if res.get("suite") not in ("sd", "ssd"):
            continue
        ng = [r for r in res["rows"] if _is_ngram(r) and r.get("batch_size", 1) == 1 and r.get("verify_steps")]
        comp_rows += [(res, r) for r in ng]
    comp_src = "n-gram SD rows (batch 1): verify_s, sample_s, overhead_s per round"
    if not comp_rows:
        for res in results:
            if res.get("suite") in ("sd", "ssd"):
                comp_rows += [(res, r) for r in res["rows"] if r.get("method", "").startswith("sd")
                              and r.get("batch_size", 1) == 1 and r.get("verify_steps")]
        comp_src = "SD rows (batch 1): verify_s, sample_s, overhead_s per round (no n-gram rows given)"
    if comp_rows:
        host = _median([r["overhead_s"] / r["verify_steps"] for _, r in comp_rows])
        spl = _median([r["sample_s"] / r["verify_steps"] / ((r["k"] + 1) * model_shape(res["target"]).vocab)
                       for res, r in comp_rows])
        hw = hw.replace(host_overhead_s=host, sample_s_per_logit=spl)
        report["components_from"] = f"{comp_src} ({len(comp_rows)} rows)"
    samples: list[ForwardSample] = []
    for res in results:
        if res.get("suite") == "ar":
            for r in res["rows"]:
                m = model_shape(r["model"])
                t = _median(r.get("tpot_s_all") or [r["tpot_s"]])
                t -= hw.host_overhead_s + sample_time(hw, m, 1)
                samples.append(ForwardSample(m, 1, 1, 64.0, t, f"{Path(res['_path']).name}: AR step"))
        if res.get("suite") == "forward":
            samples += _forward_samples(res)
    for res, r in comp_rows:
        m = model_shape(res["target"])
        samples.append(ForwardSample(m, 1, r["k"] + 1, r.get("prompt_tokens", 0) + r["generated_tokens"] / 2,
                                     r["verify_s"] / r["verify_steps"],
                                     f"{Path(res['_path']).name}: {r['method']} verify"))
    hw, rep = fit_forward(hw, samples)
    report.update(rep)
    return hw, report


def _forward_samples(res: dict) -> list[ForwardSample]:
    out = []
    for r in res["rows"]:
        m = ModelShape.from_config(r["model"], ModelConfig.from_dict(r["config"]))
        out.append(ForwardSample(m, r["batch"], r["tokens"], r["context"], r["seconds"],
                                 f"{Path(res.get('_path', 'forward')).name}: forward"))
    return out


def _group_key(r: dict) -> tuple:
    return (r.get("suite", ""), r.get("category", ""), float(r.get("temperature", 0.0) or 0.0),
            int(r.get("batch_size", 1)), r["method"])


def _method_kind(r: dict) -> str:
    m = r["method"]
    if m == "ar":
        return "ar"
    if "cache_hit_rate" in r or m.startswith("ssd"):
        return "ssd"
    return "ngram" if _is_ngram(r) else "sd"


def predict_row(hw: Hardware, res: dict, r: dict, *, iid_alpha: bool = False) -> Prediction:
    """The model's prediction for one measured results row, from its acceptance / hit inputs only."""
    target = model_shape(res["target"])
    b = int(r.get("batch_size", 1))
    ctx = r.get("prompt_tokens", 0) / b + r["generated_tokens"] / b / 2
    kind = _method_kind(r)
    if kind == "ar":
        return predict_ar(hw, target, batch=b, context=ctx)
    k = int(r["k"])
    steps = r["verify_steps"]
    tau = (r["generated_tokens"] - b) / steps / b  # measured tokens per round per row
    hist = r.get("acceptance_histogram")
    p_all = hist[-1] / sum(hist) if hist and sum(hist) else None
    if kind == "ngram":
        # the draft is a host lookup: its (tiny) measured cost stands in for a draft model
        p = predict_sd(hw, target, target, k=k, tokens_per_round=tau, p_catch_up=0.0, batch=b, context=ctx)
        t = p.round_s - p.parts["draft"] + r["draft_s"] / steps
        return Prediction("ngram", tau / t, b, 1, tau, t, {**p.parts, "draft": r["draft_s"] / steps})
    draft = model_shape(res["draft"])
    if kind == "sd":
        if iid_alpha:
            a = r["acceptance_rate"]
            return predict_sd(hw, target, draft, k=k, alpha=a, batch=b, context=ctx)
        pc = 1.0 - (1.0 - p_all) ** b if p_all is not None else None
        return predict_sd(hw, target, draft, k=k, tokens_per_round=tau, p_catch_up=pc, batch=b, context=ctx)
    fan = r.get("fanout") or {}
    budget = int(fan.get("budget") or 2 * (k + 1))
    dev = r.get("devices") or {}
    shared = bool(dev.get("single_device", True)) or hw.shared_draft
    calls = r.get("fallback_calls") or {}
    backup = "neural" if r.get("backup", "neural") == "neural" or (
        r.get("backup") == "auto" and calls.get("neural", 0) >= calls.get("ngram", 0)) else "fast"
    p_hit = float(r["cache_hit_rate"])
    t_hit = r["tau_hit"] if r.get("tau_hit") else tau
    t_miss = r["tau_miss"] if r.get("tau_miss") else tau
    if iid_alpha:
        t_hit = t_miss = expected_tokens(r["acceptance_rate"], k)
    return predict_ssd(hw, target, draft, k=k, fan_budget=budget, p_hit=p_hit, tau_hit=t_hit, tau_miss=t_miss,
                       backup=backup, batch=b, context=ctx, draft_devices=max(1, int(dev.get("draft", 1) or 1)),
                       shared=shared)


def validate(paths: list[str], hw: Hardware | None = None) -> dict:
    """Calibrate on the stated subset of ``paths``, predict every AR / SD / SSD group, compare.

    Returns ``{"hardware", "calibration", "groups", "summary"}``; each group has measured and
    predicted decode tok/s (summed decode tokens over summed decode time, prefill excluded,
    as the bench reports), the relative error, the ratios to AR (and SD) of the same group,
    per-round component times, and ``fitted`` = whether its own rows were in the fit.
    """
    hw = hw or HARDWARE["cpu"]
    results = [load_results(p) for p in paths]
    hw, cal = calibrate_from_results(results, hw)
    groups: dict[tuple, dict] = {}
    for res in results:
        if res.get("suite") not in ("sd", "ssd"):
            continue
        try:
            model_shape(res["target"]), model_shape(res["draft"])
        except KeyError as e:
            cal.setdefault("skipped", []).append(f"{res['_path']}: {e}")
            continue
        for r in res["rows"]:
            if not r.get("generated_tokens") or r["wall_s"] <= r["ttft_s"]:
                continue
            key = (Path(res["_path"]).name,) + _group_key(r)
            g = groups.setdefault(key, defaultdict(float))
            b = int(r.get("batch_size", 1))
            dtok = r["generated_tokens"] - b
            dwall = r["wall_s"] - r["ttft_s"]
            p = predict_row(hw, res, r)
            steps = r.get("verify_steps") or r.get("steps") or max(1, dtok // b)
            g["n"] += 1
            g["dtok"] += dtok
            g["dwall"] += dwall
            g["pwall"] += dtok / p.throughput
            if r["method"] != "ar" and "verify_steps" in r:
                pa = predict_row(hw, res, r, iid_alpha=True)
                g["pwall_iid"] += dtok / pa.throughput
                g["steps"] += steps
                g["m_verify"] += r["verify_s"]
                g["p_verify"] += steps * p.parts["verify"]
                dr = r.get("draft_exposed_s", r.get("draft_s", 0.0))
                g["m_draft"] += dr
                g["p_draft"] += steps * p.parts.get("draft_exposed", p.parts.get("draft", 0.0))
            g["load"] += r["loadavg"][0] if r.get("loadavg") else 0.0
            g["kind"] = _method_kind(r)
    out = []
    for key, g in groups.items():
        meas, pred = g["dtok"] / g["dwall"], g["dtok"] / g["pwall"]
        row = {"file": key[0], "part": key[1], "category": key[2], "temperature": key[3], "batch": key[4],
               "method": key[5], "kind": g["kind"], "n": int(g["n"]), "measured": meas, "predicted": pred,
               "rel_err": pred / meas - 1.0, "load": g["load"] / g["n"],
               "fitted": g["kind"] == "ngram" and key[4] == 1}
        if g.get("pwall_iid"):
            row["predicted_iid_alpha"] = g["dtok"] / g["pwall_iid"]
        if g.get("steps"):
            row.update(m_verify_round=g["m_verify"] / g["steps"], p_verify_round=g["p_verify"] / g["steps"],
                       m_draft_round=g["m_draft"] / g["steps"], p_draft_round=g["p_draft"] / g["steps"])
        out.append(row)
    idx = {(r["file"], r["part"], r["category"], r["temperature"], r["batch"], r["method"]): r for r in out}
    for r in out:
        base = idx.get((r["file"], r["part"], r["category"], r["temperature"], r["batch"], "ar"))
        if base and r["method"] != "ar":
            r["m_vs_ar"], r["p_vs_ar"] = r["measured"] / base["measured"], r["predicted"] / base["predicted"]
            r["ratio_err"] = r["p_vs_ar"] / r["m_vs_ar"] - 1.0
        if r["kind"] == "ssd":
            sd = [x for x in out if x["kind"] == "sd" and (x["file"], x["part"], x["category"], x["temperature"],
                                                          x["batch"]) == (r["file"], r["part"], r["category"],
                                                                          r["temperature"], r["batch"])]
            if sd:
                r["m_vs_sd"], r["p_vs_sd"] = r["measured"] / sd[0]["measured"], r["predicted"] / sd[0]["predicted"]
    out.sort(key=lambda r: (r["file"], r["part"], r["batch"], r["category"], r["temperature"],
                            ["ar", "sd", "ngram", "ssd"].index(r["kind"]), r["method"]))
    return {"hardware": dataclasses.asdict(hw), "calibration": cal, "groups": out, "summary": _summary(out)}


# 1-minute load average at or below which a group counts as measured on a quiet machine: the
# benchmark itself keeps both cores busy (load ≈ 2); above that another process competed.
QUIET_LOAD = 2.5


def _summary(groups: list[dict]) -> list[dict]:
    rows = []
    for kind in ("ar", "sd", "ssd", "ngram"):
        for b1 in (True, False):
            gs = [g for g in groups if g["kind"] == kind and (g["batch"] == 1) == b1]
            if not gs:
                continue
            e = np.array([g["rel_err"] for g in gs])
            re_ = np.array([g["ratio_err"] for g in gs if "ratio_err" in g])
            quiet = np.array([g["rel_err"] for g in gs if g["load"] <= QUIET_LOAD])
            rows.append({"kind": kind, "batch": "1" if b1 else ">1", "groups": len(gs),
                         "fitted": any(g["fitted"] for g in gs),
                         "mean_abs_err": float(np.mean(np.abs(e))), "mean_err": float(np.mean(e)),
                         "max_abs_err": float(np.max(np.abs(e))),
                         "ratio_mean_abs_err": float(np.mean(np.abs(re_))) if re_.size else None,
                         "quiet_groups": int(quiet.size),
                         "quiet_mean_abs_err": float(np.mean(np.abs(quiet))) if quiet.size else None})
    return rows


# --- predictions for large hardware ---------------------------------------------------------

PAPER = {"ar": 54.7, "sd": 161.8, "ssd": 255.8}  # SSD paper, average row (REFERENCE §2)
PAPER_REPRO = {"ar": 67.0, "sd": 182.0, "ssd": 283.0}  # public reproduction (SSD 280-286)
PAPER_TOKENS_PER_STEP = 5.47  # public reproduction, SSD K=7 (hit rate 0.88)
PAPER_P_HIT = 0.86  # the paper, T = 0, geometric fan-out


def predict_paper(hw: Hardware | None = None, *, context: float = 600.0, draft_loop: str = "fused",
                  link_latency_s: float | None = None, host_overhead_s: float | None = None) -> dict:
    """Llama-3.1-70B on 4 devices (tensor parallel), Llama-3.2-1B draft, batch 1, greedy.

    SSD: K=7, F=3 per position (24 branches), draft on a 5th device, neural backup,
    p_hit = 0.86 (the paper's T=0 hit rate). Acceptance: the public reproduction's 5.47 tokens
    per step at K=7 gives the i.i.d. α; SD (K=6) uses E[τ] at that α. SD's draft runs on one
    of the target's devices. ``context``: mean KV length (prompt + half of 512 new tokens).
    """
    hw = hw or HARDWARE["h100-sxm"]
    if link_latency_s is not None:
        hw = hw.replace(link_latency_s=link_latency_s)
    if host_overhead_s is not None:
        hw = hw.replace(host_overhead_s=host_overhead_s)
    T, D = model_shape("llama-3.1-70b"), model_shape("llama-3.2-1b")
    alpha = alpha_for_tokens(PAPER_TOKENS_PER_STEP, 7)
    ar = predict_ar(hw, T, context=context, tp=4)
    sd = predict_sd(hw, T, D, k=6, alpha=alpha, context=context, tp=4, draft_loop=draft_loop)
    e7 = expected_tokens(alpha, 7)
    ssd = predict_ssd(hw, T, D, k=7, fan_budget=3 * 8, p_hit=PAPER_P_HIT, tau_hit=e7, tau_miss=e7, context=context,
                      tp=4, draft_devices=1, shared=False, draft_loop=draft_loop)
    ssd_ceiling = (1 + sd.info["T_SD"]) * e7 / sd.tokens_per_round
    return {"hardware": hw.name, "alpha": alpha, "fits": fits(hw, T, 4), "draft_loop": draft_loop,
            "predictions": {"ar": ar, "sd": sd, "ssd": ssd}, "paper": PAPER, "reproduction": PAPER_REPRO,
            "ssd_over_sd_ceiling": ssd_ceiling}


def predict_qwen(hw: Hardware | None = None, *, results: list[dict] | None = None, batch: int = 1,
                 context: float = 150.0) -> dict:
    """Our Qwen2.5-Coder 1.5B target / 0.5B draft in bf16 on one H200 (shared) and on two (separate).

    Acceptance inputs: the measured CPU values of the results given (SD / SSD rows at K=4,
    greedy, batch 1), else α = 0.7 and p_hit = 0.6 (stated assumptions).
    """
    hw = hw or HARDWARE["h200"]
    T, D = model_shape("qwen2.5-coder-1.5b-instruct"), model_shape("qwen2.5-coder-0.5b-instruct")
    k, budget = 4, 10
    acc = {"tau_sd": expected_tokens(0.7, k), "p_hit": 0.6, "tau_hit": expected_tokens(0.7, k),
           "tau_miss": expected_tokens(0.7, k), "source": "assumed: alpha 0.7, p_hit 0.6"}
    sd_rows, ssd_rows = [], []
    for res in results or []:
        for r in res.get("rows", []):
            if r.get("k") != k or r.get("batch_size", 1) != 1 or float(r.get("temperature", 0) or 0) != 0.0:
                continue
            if _method_kind(r) == "sd" and res.get("draft") == D.name:
                sd_rows.append(r)
            if _method_kind(r) == "ssd" and res.get("draft") == D.name and r.get("backup", "neural") == "neural":
                ssd_rows.append(r)
    if sd_rows:
        acc["tau_sd"] = sum(r["generated_tokens"] - 1 for r in sd_rows) / sum(r["verify_steps"] for r in sd_rows)
        acc["source"] = f"measured on the CPU: {len(sd_rows)} SD-K4 rows"
        acc["tau_hit"] = acc["tau_miss"] = acc["tau_sd"]
    if ssd_rows:
        hits = [r["cache_hit_rate"] * r["verify_steps"] for r in ssd_rows]
        miss = [(1 - r["cache_hit_rate"]) * r["verify_steps"] for r in ssd_rows]
        acc["p_hit"] = sum(hits) / (sum(hits) + sum(miss))
        # round-weighted, so that p·tau_hit + (1 − p)·tau_miss is the measured tokens per round
        acc["tau_hit"] = sum(r["tau_hit"] * h for r, h in zip(ssd_rows, hits)) / max(sum(hits), 1e-9)
        acc["tau_miss"] = (sum(r["tau_miss"] * m for r, m in zip(ssd_rows, miss)) / sum(miss) if sum(miss) > 0
                           else acc["tau_hit"])
        acc["source"] += f", {len(ssd_rows)} SSD-K4 rows (hit rate, tau hit / miss)"
    ar = predict_ar(hw, T, batch=batch, context=context)
    sd = predict_sd(hw, T, D, k=k, tokens_per_round=acc["tau_sd"], batch=batch, context=context)
    kw = dict(k=k, fan_budget=budget, p_hit=acc["p_hit"], tau_hit=acc["tau_hit"], tau_miss=acc["tau_miss"],
              batch=batch, context=context)
    one = predict_ssd(hw, T, D, shared=True, **kw)
    two = predict_ssd(hw, T, D, shared=False, draft_devices=1, **kw)
    one.method, two.method = "ssd (1 device)", "ssd (2 devices)"
    return {"hardware": hw.name, "batch": batch, "acceptance": acc,
            "predictions": {"ar": ar, "sd": sd, "ssd1": one, "ssd2": two}}


# --- measuring forward passes (for the GPU check) -------------------------------------------


def measure_forward(names: list[str], *, dtype: str = "bfloat16", shapes=((1, 1), (1, 5), (1, 2048), (1, 512),
                    (16, 1), (4, 5)), context: int = 128, repeats: int = 10, out: str | None = None,
                    configs: dict[str, ModelConfig] | None = None) -> dict:
    """Time jitted forward passes (logits included) of synthetic-weight models on the default device.

    Weights are constants (timing does not depend on their values), so no checkpoint is
    needed. Shapes ``(b, T)`` run in order, every model per shape, most useful first: 1-token
    steps (overhead and bandwidth), the verify shape, two long compute-bound passes (GEMM
    efficiency), then batched shapes. Rows are written to ``out`` after every measurement,
    so a timeout keeps what ran.
    """
    import time

    import jax
    import jax.numpy as jnp

    from ssd_jax.models import llama
    from ssd_jax.models.params import param_specs, unflatten

    configs = configs or MODEL_CONFIGS
    dev = jax.devices()[0]
    res = {"suite": "forward", "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                                       "device_kind": dev.device_kind, "dtype": dtype}, "rows": []}
    params = {}
    for name in names:
        cfg = configs[name].replace(dtype=dtype)
        flat = {k: jnp.full(shape, 1.0 if k.endswith("norm") else 0.01, cfg.jnp_dtype)
                for k, (shape, _) in param_specs(cfg).items()}
        params[name] = (cfg, unflatten(cfg, flat))
    for b, T in shapes:
        for name in names:
            cfg, p = params[name]

            def fwd(p, cache, toks, cfg=cfg):
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
            res["rows"].append({"model": name, "config": cfg.to_dict(), "batch": b, "tokens": T, "context": context,
                                "seconds": _median(ts), "seconds_all": ts, "compile_s": comp})
            print(f"{name} b={b} T={T}: {_median(ts) * 1e3:.3f} ms (compile {comp:.1f} s)", file=sys.stderr)
            if out:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(res, indent=1))
    return res


# --- rendering ------------------------------------------------------------------------------


def _f(x, p=2):
    return "-" if x is None else f"{x:.{p}f}"


def _pct(x):
    return "-" if x is None else f"{100 * x:+.0f}%"


def _pct_abs(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def render_validation(v: dict) -> str:
    hw, cal = v["hardware"], v["calibration"]
    out = ["### Calibration (fitted constants)", "",
           f"Fitted: {', '.join(cal['fitted'] + (['host_overhead_s', 'sample_s_per_logit'] if 'components_from' in cal else []))}; "
           f"kept from the preset: {', '.join(cal['kept']) or 'none'}. Preset: {hw['source']}.", "",
           "1-token AR samples are the median step time minus the fitted host and sampling cost per step.", "",
           "| constant | value |", "|---|---|",
           f"| step overhead per forward | {hw['step_overhead_s'] * 1e3:.2f} ms |",
           f"| bandwidth efficiency | {hw['bw_eff']:.3f} ({hw['hbm_gb_s'] * hw['bw_eff']:.1f} GB/s) |",
           f"| GEMM half-performance length m_half | {hw['m_half']:.1f} tokens |",
           f"| flop efficiency | {hw['flop_eff']:.2f} |",
           f"| host overhead per round | {hw['host_overhead_s'] * 1e3:.2f} ms |",
           f"| sampling per position (151,936 logits) | {hw['sample_s_per_logit'] * 151936 * 1e3:.2f} ms |", "",
           f"Components from: {cal.get('components_from', '-')}.", "",
           "| calibration sample | model | b x T | measured ms | model ms | error |", "|---|---|---|---|---|---|"]
    seen = defaultdict(list)
    for r in cal["residuals"]:
        seen[(r["source"], r["model"], r["batch"], r["tokens"])].append(r)
    for (src, m, b, t), rs in seen.items():
        me = statistics.mean(x["measured_s"] for x in rs)
        pr = statistics.mean(x["predicted_s"] for x in rs)
        out.append(f"| {src}{f' (mean of {len(rs)})' if len(rs) > 1 else ''} | {m} | {b} x {t} | {me * 1e3:.0f} "
                   f"| {pr * 1e3:.0f} | {_pct(pr / me - 1)} |")
    if cal.get("skipped"):
        out += ["", "Skipped: " + "; ".join(cal["skipped"])]
    out += ["", "### Predicted vs measured decode tok/s", "",
            "Decode tok/s = summed decode tokens / summed decode time (prefill and first token excluded), all rows "
            "of the group. `fit` marks groups whose own rows were used in the calibration. Inputs per row: measured "
            "tokens per round (and, for SSD, cache hit rate, tau hit / miss, fan-out budget). `iid α` = the same "
            "model with E[τ] from the acceptance rate by the i.i.d. formula instead of the measured tokens per round.",
            "", "| file | part | category | T | b | method | n | measured | predicted | error | iid α | vs AR meas "
            "| vs AR pred | vs SD meas | vs SD pred | verify/round meas / pred s | draft (exposed)/round meas / pred s "
            "| load | fit |", "|" + "---|" * 20]
    for r in v["groups"]:
        comp_v = (f"{r['m_verify_round']:.2f} / {r['p_verify_round']:.2f}" if "m_verify_round" in r else "-")
        comp_d = (f"{r['m_draft_round']:.2f} / {r['p_draft_round']:.2f}" if "m_draft_round" in r else "-")
        out.append(f"| {r['file']} | {r['part']} | {r['category']} | {r['temperature']:g} | {r['batch']} "
                   f"| {r['method']} | {r['n']} | {r['measured']:.2f} | {r['predicted']:.2f} | {_pct(r['rel_err'])} "
                   f"| {_f(r.get('predicted_iid_alpha'))} | {_f(r.get('m_vs_ar'))} | {_f(r.get('p_vs_ar'))} "
                   f"| {_f(r.get('m_vs_sd'))} | {_f(r.get('p_vs_sd'))} | {comp_v} | {comp_d} | {r['load']:.1f} "
                   f"| {'fit' if r['fitted'] else ''} |")
    out += ["", "### Error summary", "",
            f"`quiet`: only the groups measured at a mean 1-minute load average ≤ {QUIET_LOAD} (the benchmark "
            "alone keeps the 2 cores at ≈ 2; more means another process competed for them).", "",
            "| method | batch | groups | in fit | mean abs error (tok/s) | mean error | max abs error "
            "| mean abs error of the ratio to AR | quiet groups | quiet mean abs error |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for s in v["summary"]:
        out.append(f"| {s['kind']} | {s['batch']} | {s['groups']} | {'yes' if s['fitted'] else 'no'} "
                   f"| {100 * s['mean_abs_err']:.0f}% | {_pct(s['mean_err'])} | {100 * s['max_abs_err']:.0f}% "
                   f"| {_pct_abs(s['ratio_mean_abs_err'])} | {s['quiet_groups']} "
                   f"| {_pct_abs(s['quiet_mean_abs_err'])} |")
    return "\n".join(out) + "\n"


_PRED_HEAD = ("| method | tok/s per sequence | tok/s per device (throughput / devices) | devices | tokens/round "
              "| round ms | parts (ms per round) |")


def _pred_row(name: str, p: Prediction, refs: tuple = ()) -> str:
    parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in p.parts.items())
    cells = [name, f"{p.tokens_per_s:.1f}", f"{p.tokens_per_s_per_device:.1f}", str(p.devices),
             f"{p.tokens_per_round:.2f}", f"{p.round_s * 1e3:.2f}", parts, *refs]
    return "| " + " | ".join(cells) + " |"


def render_paper(d: dict, sens: list[dict] | None = None) -> str:
    p = d["predictions"]
    h100 = d["hardware"] == HARDWARE["h100-sxm"].name
    ref = "paper" if h100 else "paper (on H100)"
    out = [f"### SSD paper setting: Llama-3.1-70B (4 x {d['hardware']}, TP) + Llama-3.2-1B draft, batch 1, greedy", "",
           f"Acceptance: α = {d['alpha']:.3f} (the i.i.d. α giving the public reproduction's {PAPER_TOKENS_PER_STEP} "
           f"tokens/step at K=7); SD K=6 E[τ] = {p['sd'].tokens_per_round:.2f}; SSD K=7, F=3 (24 branches), p_hit = "
           f"{PAPER_P_HIT}, neural backup; draft loop: {d['draft_loop']}; 70B fits on 4 devices: {d['fits']}.", "",
           _PRED_HEAD + f" {ref} | model vs {ref} | public reproduction |", "|" + "---|" * 10]
    for m in ("ar", "sd", "ssd"):
        pr = d["paper"][m]
        out.append(_pred_row(m.upper(), p[m], (f"{pr:.1f}", _pct(p[m].tokens_per_s / pr - 1),
                                                f"{d['reproduction'][m]:.1f}")))
    ar, sd, ssd = (p[m].tokens_per_s for m in ("ar", "sd", "ssd"))
    pa = d["paper"]
    out += ["", f"| ratio | model | {ref} |", "|---|---|---|",
            f"| SD / AR | {sd / ar:.2f} | {pa['sd'] / pa['ar']:.2f} |",
            f"| SSD / AR | {ssd / ar:.2f} | {pa['ssd'] / pa['ar']:.2f} |",
            f"| SSD / SD | {ssd / sd:.2f} | {pa['ssd'] / pa['sd']:.2f} |",
            f"| SSD / SD ceiling (1 + T_SD)·E_hit/E_SD | {d['ssd_over_sd_ceiling']:.2f} | - |",
            f"| SSD / AR per device | {p['ssd'].tokens_per_s_per_device / p['ar'].tokens_per_s_per_device:.2f} "
            f"| {pa['ssd'] / 5 / (pa['ar'] / 4):.2f} |", "",
            f"SSD: T_p = {p['ssd'].info['T_p']:.2f} verify units (build "
            f"{'hidden' if p['ssd'].info['build_hidden'] else 'NOT hidden'}), T_b = {p['ssd'].info['T_b']:.2f}; SD: "
            f"T_SD = {p['sd'].info['T_SD']:.2f}, draft share of the round {100 * p['sd'].info['draft_share']:.0f}% "
            "(SSD can only hide this share)."]
    if sens:
        out += ["", "Sensitivity (same model, one assumption changed):", "",
                "| assumption | AR | SD | SSD | SSD / AR | SSD / SD |", "|---|---|---|---|---|---|"]
        for s in sens:
            q = s["d"]["predictions"]
            a, b, c = (q[m].tokens_per_s for m in ("ar", "sd", "ssd"))
            out.append(f"| {s['label']} | {a:.1f} | {b:.1f} | {c:.1f} | {c / a:.2f} | {c / b:.2f} |")
        out.append(f"| {ref} | {pa['ar']} | {pa['sd']} | {pa['ssd']} | {pa['ssd'] / pa['ar']:.2f} "
                   f"| {pa['ssd'] / pa['sd']:.2f} |")
    return "\n".join(out) + "\n"


def render_qwen(d: dict) -> str:
    p = d["predictions"]
    acc = d["acceptance"]
    out = [f"### Qwen2.5-Coder 1.5B target + 0.5B draft, bf16, {d['hardware']}, batch {d['batch']}", "",
           f"Acceptance ({acc['source']}): SD-K4 tokens/round {acc['tau_sd']:.2f}; SSD-K4 p_hit {acc['p_hit']:.2f}, "
           f"tau hit {acc['tau_hit']:.2f}, tau miss {acc['tau_miss']:.2f}; fan-out budget 10 branches.", "",
           _PRED_HEAD + " vs AR |", "|" + "---|" * 8]
    for k, name in (("ar", "AR"), ("sd", "SD K=4"), ("ssd1", "SSD K=4, 1 device (serialised)"),
                    ("ssd2", "SSD K=4, 2 devices")):
        out.append(_pred_row(name, p[k], (f"{p[k].tokens_per_s / p['ar'].tokens_per_s:.2f}x",)))
    out += ["", f"Two-device SSD: T_p = {p['ssd2'].info['T_p']:.2f} verify units "
            f"(build {'hidden' if p['ssd2'].info['build_hidden'] else 'NOT hidden: the draft is too slow to hide'}); "
            f"SD draft share of the round {100 * p['sd'].info['draft_share']:.0f}%."]
    return "\n".join(out) + "\n"


def render_forward_fit(hw: Hardware, rep: dict) -> str:
    out = [f"### Forward-time fit on {hw.name}", "", f"Fitted: {', '.join(rep['fitted'])}; kept: "
           f"{', '.join(rep['kept']) or 'none'}.", "",
           f"step overhead {hw.step_overhead_s * 1e3:.3f} ms, bw_eff {hw.bw_eff:.3f}, flop_eff {hw.flop_eff:.3f}, "
           f"m_half {hw.m_half:.1f}", "", "| model | b x T | measured ms | model ms | error |", "|---|---|---|---|---|"]
    for r in rep["residuals"]:
        out.append(f"| {r['model']} | {r['batch']} x {r['tokens']} | {r['measured_s'] * 1e3:.3f} "
                   f"| {r['predicted_s'] * 1e3:.3f} | {_pct(r['predicted_s'] / r['measured_s'] - 1)} |")
    return "\n".join(out) + "\n"


def render_hardware() -> str:
    out = ["### Hardware presets", "", "| preset | HBM GB/s | peak TFLOP/s | memory GB | bw_eff | flop_eff | m_half "
           "| step overhead ms | host ms/round | link GB/s | link latency µs | bytes/param | source |",
           "|" + "---|" * 13]
    for k, h in HARDWARE.items():
        out.append(f"| {k} | {h.hbm_gb_s:g} | {h.peak_tflops:g} | {h.memory_gb:g} | {h.bw_eff:.2f} | {h.flop_eff:.2f} "
                   f"| {h.m_half:g} | {h.step_overhead_s * 1e3:.2f} | {h.host_overhead_s * 1e3:.2f} | {h.link_gb_s:g} "
                   f"| {h.link_latency_s * 1e6:g} | {h.bytes_per_param} | {h.source} |")
    return "\n".join(out) + "\n"


def _jsonable(x):
    if isinstance(x, Prediction):
        return x.to_dict()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def paper_sensitivity(hw: Hardware) -> list[dict]:
    base = predict_paper(hw)
    return [
        {"label": "baseline (as above)", "d": base},
        {"label": "draft loop: host round trip per draft step", "d": predict_paper(hw, draft_loop="per_step")},
        {"label": "all-reduce latency 20 µs (NCCL-like)", "d": predict_paper(hw, link_latency_s=20e-6)},
        {"label": "all-reduce latency 5 µs", "d": predict_paper(hw, link_latency_s=5e-6)},
        {"label": "host overhead 0.3 ms per round", "d": predict_paper(hw, host_overhead_s=0.3e-3)},
        {"label": "host overhead 2.5 ms per round", "d": predict_paper(hw, host_overhead_s=2.5e-3)},
        {"label": "bandwidth efficiency 0.7", "d": predict_paper(hw.replace(bw_eff=0.7))},
    ]


def update_doc(path: str, validate_paths: list[str]) -> None:
    """Rewrite the generated blocks of a markdown file (``<!-- perfmodel:NAME -->`` ...
    ``<!-- /perfmodel:NAME -->``, NAME in hardware, validation, paper, qwen) with fresh output."""
    here = Path("experiments/results")
    acc = [load_results(x) for x in sorted(here.glob("sd_cpu*.json")) + sorted(here.glob("ssd_cpu*.json"))]
    fresh = {"hardware": render_hardware, "paper": lambda: render_paper(predict_paper(), paper_sensitivity(
        HARDWARE["h100-sxm"])), "qwen": lambda: render_qwen(predict_qwen(results=acc)) + "\n" + render_qwen(
        predict_qwen(results=acc, batch=8))}
    if validate_paths:
        fresh["validation"] = lambda: render_validation(validate(validate_paths))
    text = Path(path).read_text()
    for name, make in fresh.items():
        a, b = f"<!-- perfmodel:{name} -->", f"<!-- /perfmodel:{name} -->"
        if a in text and b in text:
            i, j = text.index(a) + len(a), text.index(b)
            text = text[:i] + "\n" + make() + text[j:]
    Path(path).write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssd_jax.perfmodel", description=__doc__.split("\n")[0])
    p.add_argument("--validate", nargs="+", metavar="RESULTS_JSON",
                   help="calibrate on this CPU's results and compare predictions with the measurements")
    p.add_argument("--predict", nargs="+", choices=["paper", "qwen-h200"], default=[])
    p.add_argument("--hardware", help="the base hardware of --validate / --calibrate-forward and the hardware of "
                   "--predict (" + ", ".join(HARDWARE) + ")")
    p.add_argument("--acceptance-from", nargs="*", metavar="RESULTS_JSON",
                   help="results whose measured acceptance / hit rates feed --predict qwen-h200 "
                        "(default: the SD / SSD CPU results in experiments/results that exist)")
    p.add_argument("--batch", type=int, default=1, help="batch size of --predict qwen-h200")
    p.add_argument("--measure", nargs="+", metavar="MODEL", help="time synthetic-weight forward passes (GPU check)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", help="where --measure writes its rows")
    p.add_argument("--calibrate-forward", nargs="+", metavar="RESULTS_JSON",
                   help="fit --hardware's forward constants on --measure rows and/or AR-suite results, "
                        "then use them for --predict")
    p.add_argument("--show-hardware", action="store_true", help="print the hardware presets")
    p.add_argument("--update-doc", metavar="MARKDOWN", help="rewrite the generated blocks of this file (e.g. "
                   "experiments/perf_model.md) with fresh tables; --validate FILES feeds its validation block")
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown tables")
    a = p.parse_args(argv)
    doc: dict[str, Any] = {}
    md: list[str] = []
    if a.show_hardware:
        doc["hardware"] = {k: dataclasses.asdict(h) for k, h in HARDWARE.items()}
        md.append(render_hardware())
    if a.measure:
        doc["measure"] = measure_forward(a.measure, dtype=a.dtype, out=a.out)
    if a.update_doc:
        update_doc(a.update_doc, a.validate or [])
        print(f"updated {a.update_doc}", file=sys.stderr)
        return 0
    hw_override = get_hardware(a.hardware) if a.hardware else None
    if a.validate:
        v = validate(a.validate, hw_override)
        doc["validation"] = v
        md.append(render_validation(v))
    if a.calibrate_forward:
        base = hw_override or HARDWARE["h200"]
        samples: list[ForwardSample] = []
        for path in a.calibrate_forward:
            res = load_results(path)
            if res.get("suite") == "forward":
                samples += _forward_samples(res)
            elif res.get("suite") == "ar":
                for r in res["rows"]:
                    m = model_shape(r["model"])
                    t = _median(r.get("tpot_s_all") or [r["tpot_s"]]) - base.host_overhead_s
                    base = base.replace(bytes_per_param=_itemsize(r, base.bytes_per_param))
                    samples.append(ForwardSample(m, 1, 1, 64.0, t, Path(path).name + ": AR step"))
        hw_override, rep = fit_forward(base, samples)
        doc["forward_fit"] = {"hardware": dataclasses.asdict(hw_override), **rep}
        md.append(render_forward_fit(hw_override, rep))
    for what in a.predict:
        if what == "paper":
            hw = hw_override or HARDWARE["h100-sxm"]
            d = predict_paper(hw)
            sens = paper_sensitivity(hw)
            doc["paper"] = {**d, "sensitivity": [{"label": s["label"], **s["d"]} for s in sens]}
            md.append(render_paper(d, sens))
        else:
            paths = a.acceptance_from
            if paths is None:
                here = Path("experiments/results")
                paths = [str(x) for x in sorted(here.glob("sd_cpu*.json")) + sorted(here.glob("ssd_cpu*.json"))]
            results = [load_results(x) for x in paths]
            d = predict_qwen(hw_override or HARDWARE["h200"], results=results, batch=a.batch)
            doc["qwen_h200"] = d
            md.append(render_qwen(d))
    if not (a.validate or a.predict or a.measure or a.calibrate_forward or a.show_hardware):
        p.print_help()
        return 0
    if a.json:
        print(json.dumps(_jsonable(doc), indent=1))
    else:
        print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
