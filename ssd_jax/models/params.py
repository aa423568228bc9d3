"""Weight declarations: every parameter is declared once with its shape and logical axes.

From :func:`param_specs` come the random initialisation (tests, training), the abstract
shapes, the shardings (``ssd_jax.sharding``) and the checks the loaders run on converted
weights. The parameter pytree is::

    {"embed": (V, D),
     "layers": [ {"attn_norm": (D,), "wq": (H, hd, D), "wk": (KVH, hd, D), "wv": (KVH, hd, D),
                  ["bq": (H, hd), "bk": (KVH, hd), "bv": (KVH, hd)],
                  "wo": (D, H, hd), "mlp_norm": (D,),
                  "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F)}, ... ],
     "final_norm": (D,),
     ["lm_head": (V, D)]}          # absent when embeddings are tied

Matrices are declared (out, in), the layout of torch / GGUF / safetensors checkpoints, and
multiplied as ``x @ W.T``. ``cfg.forms`` (``ssd_jax.models.forms``) may store a matrix
(in, out) instead (shapes and logical axes above with the in and out groups swapped, e.g.
"wq": (D, H, hd)), chosen per backend: on XLA:CPU the best form at a few rows depends on
the shape. Checkpoints and converted caches stay (out, in); :func:`to_layout` transposes one
tensor at load. Layers are a
Python list of per-layer dicts: on CPU the unrolled loop is markedly faster per decode
step than ``lax.scan`` over stacked weights (docs/reference.md §9).

Flat names ("layers.3.wq") are used on disk and by the loaders.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.forms import CANONICAL

Params = dict[str, Any]

# logical axis names, mapped to mesh axes in ssd_jax.sharding
EMBED, VOCAB, HEADS, KV_HEADS, HEAD_DIM, MLP = "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp"


#: matrix name (last part of the flat name) -> (forms role, number of leading "out" axes in (out, in) layout)
MATRICES = {
    "wq": ("q", 2),
    "wk": ("k", 2),
    "wv": ("v", 2),
    "wo": ("o", 1),
    "w_gate": ("gate", 1),
    "w_up": ("up", 1),
    "w_down": ("down", 1),
    "lm_head": ("head", 1),
}


def matrix_role(cfg: ModelConfig, name: str) -> tuple[str, int] | None:
    """(forms role, out-axis count) of a flat or layer-local parameter name; None for non-matrices."""
    base = name.split(".")[-1]
    if base == "embed":
        return ("head", 1) if cfg.tie_embeddings else None  # a tied embedding is the head
    return MATRICES.get(base)


def cast_matrices(cfg: ModelConfig, params: Params, dtype) -> Params:
    """``params`` with every weight matrix (those :func:`matrix_role` names, and a trimmed draft
    head ``"head"``) cast to ``dtype``; norms, biases and index arrays keep theirs (a new pytree:
    ``params`` is left as it is)."""

    def cast(name, leaf):
        return leaf.astype(dtype) if name == "head" or matrix_role(cfg, name) is not None else leaf

    out = {k: cast(k, v) for k, v in params.items() if k != "layers"}
    if "layers" in params:
        out["layers"] = [{k: cast(k, v) for k, v in layer.items()} for layer in params["layers"]]
    return out


def _perm(ndim: int, n_out: int, layout: str) -> tuple[int, ...]:
    """Axis order taking the (out..., in...) declaration to ``layout``."""
    return tuple(range(ndim)) if layout == "oi" else tuple(range(n_out, ndim)) + tuple(range(n_out))


def _laid_out(cfg: ModelConfig, name: str, spec):
    role = matrix_role(cfg, name)
    if role is None:
        return spec
    perm = _perm(len(spec[0]), role[1], getattr(cfg.forms, role[0]).layout)
    return tuple(spec[0][i] for i in perm), tuple(spec[1][i] for i in perm)


def layer_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Layer-local name -> (shape, logical axes) in ``cfg.forms``' storage layout."""
    D, H, KVH, hd, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    s = {
        "attn_norm": ((D,), (None,)),
        "wq": ((H, hd, D), (HEADS, HEAD_DIM, EMBED)),
        "wk": ((KVH, hd, D), (KV_HEADS, HEAD_DIM, EMBED)),
        "wv": ((KVH, hd, D), (KV_HEADS, HEAD_DIM, EMBED)),
        "wo": ((D, H, hd), (EMBED, HEADS, HEAD_DIM)),
        "mlp_norm": ((D,), (None,)),
        "w_gate": ((F, D), (MLP, EMBED)),
        "w_up": ((F, D), (MLP, EMBED)),
        "w_down": ((D, F), (EMBED, MLP)),
    }
    s = {k: _laid_out(cfg, k, v) for k, v in s.items()}
    if cfg.qkv_bias:
        s["bq"] = ((H, hd), (HEADS, HEAD_DIM))
        s["bk"] = ((KVH, hd), (KV_HEADS, HEAD_DIM))
        s["bv"] = ((KVH, hd), (KV_HEADS, HEAD_DIM))
    return s


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Flat name -> (shape, logical axes) for every parameter of ``cfg``."""
    D, V = cfg.hidden_size, cfg.vocab_size
    specs = {"embed": _laid_out(cfg, "embed", ((V, D), (VOCAB, EMBED))), "final_norm": ((D,), (None,))}
    if not cfg.tie_embeddings:
        specs["lm_head"] = _laid_out(cfg, "lm_head", ((V, D), (VOCAB, EMBED)))
    for i in range(cfg.num_layers):
        for k, v in layer_specs(cfg).items():
            specs[f"layers.{i}.{k}"] = v
    return specs


def from_checkpoint(cfg: ModelConfig, name: str, w: np.ndarray) -> np.ndarray:
    """A checkpoint tensor (torch/GGUF (out, in) matrix, or a vector) in our layout for ``name``.

    ``name`` is a flat name ("layers.3.wq", "lm_head", ...). Only reshapes: no data moves. The
    result is in the checkpoint layout whatever ``cfg.forms`` says (see :func:`to_layout`).
    """
    cfg = cfg.replace(forms=CANONICAL)
    shape = (
        param_specs(cfg)[name][0]
        if not name.startswith("layers.")
        else layer_specs(cfg)[name.split(".")[-1]][0]
    )
    if w.size != int(np.prod(shape)):
        raise ValueError(f"tensor for {name} has {w.size} elements ({w.shape}), expected shape {shape}")
    return w.reshape(shape)


def to_layout(src: ModelConfig, dst: ModelConfig, name: str, w):
    """Tensor ``name`` stored as ``src.forms`` says, in ``dst.forms``' layout (numpy or jax array).

    A no-op (the same object) when the layouts agree; otherwise one transposed, contiguous copy
    (the caller drops the original, so each weight exists once).
    """
    role = matrix_role(src, name)
    if role is None:
        return w
    a, b = getattr(src.forms, role[0]).layout, getattr(dst.forms, role[0]).layout
    if a == b:
        return w
    to_oi = _perm(w.ndim, w.ndim - role[1], "io")  # (in..., out...) -> (out..., in...)
    perm = to_oi if a == "io" else _perm(w.ndim, role[1], "io")
    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(w.transpose(perm))
    return jnp.transpose(w, perm)


def unflatten(cfg: ModelConfig, flat: dict[str, Any]) -> Params:
    """Flat name -> array dict into the nested parameter pytree."""
    p: Params = {"embed": flat["embed"], "final_norm": flat["final_norm"], "layers": []}
    if not cfg.tie_embeddings:
        p["lm_head"] = flat["lm_head"]
    for i in range(cfg.num_layers):
        p["layers"].append({k: flat[f"layers.{i}.{k}"] for k in layer_specs(cfg)})
    return p


def flatten(params: Params) -> dict[str, Any]:
    flat = {k: v for k, v in params.items() if k != "layers"}
    for i, layer in enumerate(params["layers"]):
        for k, v in layer.items():
            flat[f"layers.{i}.{k}"] = v
    return flat


def check_flat(cfg: ModelConfig, flat: dict[str, Any]) -> None:
    """Raise ValueError if ``flat`` does not match the declaration of ``cfg``."""
    specs = param_specs(cfg)
    missing = sorted(set(specs) - set(flat))
    extra = sorted(set(flat) - set(specs))
    if missing or extra:
        raise ValueError(f"weights do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (shape, _) in specs.items():
        if tuple(flat[name].shape) != tuple(shape):
            raise ValueError(f"weight {name} has shape {tuple(flat[name].shape)}, expected {shape}")


def init_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.02) -> Params:
    """Random parameters (tests, training from scratch): N(0, scale) matrices, unit norms.

    Drawn with numpy from an integer seed: deterministic, and free of the compile time that
    dozens of differently shaped ``jax.random`` calls would cost.
    """
    rng = np.random.default_rng(seed)
    flat = {}
    for name, (shape, _) in sorted(param_specs(cfg).items()):
        if name.endswith("norm"):
            flat[name] = jnp.ones(shape, cfg.jnp_dtype)
        else:
            flat[name] = jnp.asarray((scale * rng.standard_normal(shape, dtype=np.float32)), cfg.jnp_dtype)
    return unflatten(cfg, flat)


def count_params(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    n = 0
    for name, (shape, _) in param_specs(cfg).items():
        if not include_embeddings and name in ("embed", "lm_head"):
            continue
        n += int(np.prod(shape))
    return n


def weight_bytes_per_token(cfg: ModelConfig, bytes_per_param: int = 4) -> int:
    """Bytes of weights read per decode step (the embedding row read is negligible)."""
    n = count_params(cfg) - cfg.vocab_size * cfg.hidden_size  # embedding: one row per token
    if cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.hidden_size  # but the tied head reads all of it
    return n * bytes_per_param
