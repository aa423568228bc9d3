"""The draft's architecture and initial weights: sized by the SDSL law, initialised from the target."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ssd_jax.analysis import sdsl
from ssd_jax.errors import UserError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import count_params, layer_specs, weight_bytes_per_token
from ssd_jax.training.args import INIT_MODES, parse_size


def layer_param_count(cfg: ModelConfig) -> int:
    return sum(int(np.prod(shape)) for shape, _ in layer_specs(cfg).values())


def shared_names(cfg: ModelConfig) -> list[str]:
    """The target tensors a draft of ``cfg``'s width shares instead of storing."""
    return ["embed"] if cfg.tie_embeddings else ["embed", "lm_head"]


def size_draft(target_cfg: ModelConfig, size: str | float) -> tuple[ModelConfig, dict[str, Any]]:
    """The draft's config for a parameter budget, and how it was sized (for the metadata).

    The width, heads and FFN are the target's (the embedding is shared); the depth is
    ``round(N / params per layer)``, at least 1, where N counts the draft's non-embedding
    parameters. ``size="auto"``: N = SDSL N_opt for the target's total parameter count.
    """
    n_req = parse_size(size)
    m_total = count_params(target_cfg)
    m_nonemb = count_params(target_cfg, include_embeddings=False)
    law: dict[str, Any] = {
        "M": m_total,
        "M_convention": "target total parameters, tied embeddings counted once (ssd_jax.sdsl)",
        "N_convention": "draft parameters excluding the embedding shared with the target (its layers + final norm)",
        "n_opt": sdsl.n_opt(m_total),
        "n_opt_if_M_nonembedding": sdsl.n_opt(m_nonemb),
        "target_nonembedding": m_nonemb,
    }
    n = law["n_opt"] if n_req is None else n_req
    per_layer = layer_param_count(target_cfg)
    depth = max(1, int(round((n - target_cfg.hidden_size) / per_layer)))
    cfg = target_cfg.replace(num_layers=depth)
    law.update(sizing="auto" if n_req is None else "explicit", n_requested=n, params_per_layer=per_layer)
    if depth >= target_cfg.num_layers:
        warnings.warn(
            f"--size {size} gives a draft with {depth} layers, as deep as or deeper than the target "
            f"({target_cfg.num_layers} layers): speculation cannot pay off",
            stacklevel=2,
        )
    return cfg, law


def param_report(cfg: ModelConfig, target_cfg: ModelConfig) -> dict[str, Any]:
    shared = shared_names(cfg)
    n_shared = sum(cfg.vocab_size * cfg.hidden_size for _ in shared)
    trained = count_params(cfg) - n_shared
    reads = weight_bytes_per_token(cfg, 1)
    return {
        "trained": trained,
        "shared": n_shared,
        "total": trained + n_shared,
        "N": trained,
        "reads_per_token": reads,
        "target_reads_per_token": weight_bytes_per_token(target_cfg, 1),
        "cost_ratio": reads / weight_bytes_per_token(target_cfg, 1),
    }


def init_layer_indices(mode: str, target_layers: int, depth: int) -> list[int] | None:
    """Which target layers initialise the draft's layers (None: random init)."""
    m = str(mode).strip().lower()
    if m == "none":
        return None
    if m == "first":
        return [min(i, target_layers - 1) for i in range(depth)]
    if m == "spread":
        if depth == 1:
            return [0]
        return [round(i * (target_layers - 1) / (depth - 1)) for i in range(depth)]
    try:
        idx = [int(x) for x in m.split(",") if x.strip()]
    except ValueError:
        raise UserError(
            f"--init-layers must be {', '.join(INIT_MODES)} or a list of layer indices, got {mode!r}"
        ) from None
    if len(idx) != depth or any(not 0 <= i < target_layers for i in idx):
        raise UserError(
            f"--init-layers {mode!r}: need {depth} indices in [0, {target_layers}) for this draft"
        )
    return idx


def init_trained(
    target_params, target_cfg: ModelConfig, cfg: ModelConfig, mode: str, seed: int
) -> dict[str, Any]:
    """The draft's trainable pytree ``{"layers": [...], "final_norm"}`` (fresh buffers, float32)."""
    import jax.numpy as jnp

    from ssd_jax.models.params import init_params

    idx = init_layer_indices(mode, target_cfg.num_layers, cfg.num_layers)
    if idx is None:
        rnd = init_params(cfg.replace(dtype="float32"), seed)
        layers = rnd["layers"]
    else:
        layers = [
            {k: jnp.array(v, jnp.float32, copy=True) for k, v in target_params["layers"][i].items()}
            for i in idx
        ]
    return {"layers": layers, "final_norm": jnp.array(target_params["final_norm"], jnp.float32, copy=True)}
