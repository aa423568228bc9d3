"""Hardware presets of the performance model (one accelerator, or this CPU, as the model sees it)."""

from __future__ import annotations

import dataclasses

from ssd_jax.analysis.perfmodel.shapes import MODEL_CONFIGS
from ssd_jax.models.params import weight_bytes_per_token


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


# The vLLM study's H100 latency model (docs/reference.md §8, Llama-3.1-8B): a target forward costs
# 5.9 ms + 21 µs per batched token; per-step host overhead 1.2 ms. With an assumed 85% of
# the 3.35 TB/s spec for the weight stream, the part of the 5.9 ms that the 16 GB of bf16
# weights do not explain is the per-forward launch cost; 21 µs per token of 2·N FLOPs gives
# the achieved GEMM fraction.
_H100_BW_EFF = 0.85
_VLLM_8B_FWD_S, _VLLM_8B_PER_TOKEN_S, _VLLM_HOST_S = 5.9e-3, 21e-6, 1.2e-3
_H100_STEP_S = _VLLM_8B_FWD_S - weight_bytes_per_token(MODEL_CONFIGS["llama-3.1-8b"], 2) / (
    3350e9 * _H100_BW_EFF
)
_H100_FLOP_EFF = 2 * weight_bytes_per_token(MODEL_CONFIGS["llama-3.1-8b"], 1) / _VLLM_8B_PER_TOKEN_S / 989e12
_GPU_NOTE = (
    f"bw_eff {_H100_BW_EFF} assumed; step overhead {_H100_STEP_S * 1e3:.2f} ms and flop_eff "
    f"{_H100_FLOP_EFF:.2f} derived from the vLLM study's H100 latency model (docs/reference.md §8); host "
    f"{_VLLM_HOST_S * 1e3:.1f} ms per round from the same study; all-reduce latency 10 µs assumed"
)

HARDWARE: dict[str, Hardware] = {
    "h100-sxm": Hardware(
        "H100-SXM",
        3350,
        989,
        80,
        _H100_STEP_S,
        _VLLM_HOST_S,
        450,
        10e-6,
        _H100_BW_EFF,
        _H100_FLOP_EFF,
        source="spec sheet (HBM3 3.35 TB/s, 989 TFLOP/s bf16 dense, NVLink4 "
        "900 GB/s both ways); " + _GPU_NOTE,
    ),
    "h200": Hardware(
        "H200",
        4800,
        989,
        141,
        _H100_STEP_S,
        _VLLM_HOST_S,
        450,
        10e-6,
        _H100_BW_EFF,
        _H100_FLOP_EFF,
        source="spec sheet (HBM3e 4.8 TB/s, same compute as H100); efficiencies and overheads as "
        "H100 until experiments/gpu_check.sh measures them",
    ),
    "a100-80gb": Hardware(
        "A100-80GB",
        2039,
        312,
        80,
        _H100_STEP_S,
        _VLLM_HOST_S,
        300,
        10e-6,
        _H100_BW_EFF,
        _H100_FLOP_EFF,
        source="spec sheet (HBM2e 2.04 TB/s, 312 TFLOP/s bf16, NVLink3 600 GB/s "
        "both ways); efficiencies and overheads as H100 (assumed)",
    ),
    "tpu-v5e": Hardware(
        "TPU v5e",
        819,
        197,
        16,
        _H100_STEP_S,
        _VLLM_HOST_S,
        100,
        10e-6,
        _H100_BW_EFF,
        0.6,
        source="spec sheet (819 GB/s HBM2, 197 TFLOP/s bf16, 16 GB, ICI 1600 Gbps); flop_eff 0.6, "
        "overheads as H100 (assumed)",
    ),
    # this development CPU: bandwidth measured by the AR suite (experiments/results/ar_cpu.json);
    # peak = 2 vCPU x 2.45 GHz x 32 f32 FLOP/cycle (AVX2, two FMA pipes), assumed. The efficiency
    # and overhead values are priors: validate() refits them on the measured results.
    "cpu": Hardware(
        "this CPU (2 cores, f32)",
        21.6,
        0.157,
        24,
        5e-3,
        1e-3,
        1e3,
        0.0,
        0.9,
        0.6,
        m_half=18.0,
        sample_s_per_logit=2e-8,
        bytes_per_param=4,
        shared_draft=True,
        source="bandwidth 21.6 GB/s measured (ar_cpu.json); peak f32 157 GFLOP/s assumed; flop_eff "
        "0.6 assumed; other constants fitted by validate()",
    ),
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
