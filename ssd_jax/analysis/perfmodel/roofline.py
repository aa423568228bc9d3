"""The time model itself: one forward pass (roofline with overheads) and one decode round per
method (AR, SD, SSD by Theorem 7 / Corollary 16); see :mod:`ssd_jax.analysis.perfmodel`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ssd_jax.analysis.perfmodel.hardware import Hardware
from ssd_jax.analysis.perfmodel.shapes import ModelShape
from ssd_jax.analysis.sdsl import expected_tokens
from ssd_jax.analysis.speedup import predicted_speedup

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


def forward_time(
    hw: Hardware, m: ModelShape, *, batch: int = 1, tokens: int = 1, context: float = 0.0, tp: int = 1
) -> ForwardTime:
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


def alpha_for_tokens(tau: float, k: int) -> float:
    """The i.i.d. acceptance α whose E[τ] at lookahead K is ``tau`` (bisection)."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tokens per round must be in [1, K+1], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if expected_tokens(mid, k) < tau else (lo, mid)
    return 0.5 * (lo + hi)


def predict_ar(
    hw: Hardware, target: ModelShape, *, batch: int = 1, context: float = 512, tp: int = 1
) -> Prediction:
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


def predict_sd(
    hw: Hardware,
    target: ModelShape,
    draft: ModelShape,
    *,
    k: int,
    alpha: float | None = None,
    tokens_per_round: float | None = None,
    p_catch_up: float | None = None,
    batch: int = 1,
    context: float = 512,
    tp: int = 1,
    draft_hw: Hardware | None = None,
    draft_loop: str = "fused",
) -> Prediction:
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
    return Prediction(
        "sd",
        tokens_per_round / t,
        batch,
        tp,
        tokens_per_round,
        t,
        {"draft": t_draft, "verify": t_ver, "overhead": over},
        {"k": k, "T_SD": t_draft / (t_ver + over), "draft_share": t_draft / t},
    )


def predict_ssd(
    hw: Hardware,
    target: ModelShape,
    draft: ModelShape,
    *,
    k: int,
    fan_budget: int,
    p_hit: float,
    tau_hit: float,
    tau_miss: float,
    backup: str = "neural",
    batch: int = 1,
    context: float = 512,
    tp: int = 1,
    draft_devices: int = 1,
    shared: bool | None = None,
    draft_hw: Hardware | None = None,
    draft_loop: str = "fused",
    t_fast: float = 0.0,
) -> Prediction:
    """SSD by Theorem 7 / Corollary 16 (``analysis.speedup.predicted_speedup``) with modelled component times.

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
    rerun = (
        forward_time(dhw, draft, batch=batch, tokens=k + 1, context=context).total
        + sample_time(dhw, draft, batch * (k + 1))
        + sync
    )
    branch = (
        forward_time(dhw, draft, batch=batch, tokens=max(1, round(per_dev / batch)), context=context).total
        + sample_time(dhw, draft, per_dev)
        + sync
    )
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
    return Prediction(
        "ssd",
        tps,
        batch,
        devices,
        tokens,
        tokens / tps,
        {"verify": t_ver, "overhead": over, "build": build, "backup": t_b, "draft_exposed": exposed},
        {
            "k": k,
            "T_p": T_p,
            "T_b": T_b,
            "unit_s": unit,
            "speedup_units": S,
            "shared": shared,
            "build_hidden": (not shared) and build <= u,
        },
    )
