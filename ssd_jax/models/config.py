"""Model configuration for the Llama / Qwen2 decoder family.

One frozen, hashable dataclass covers both families: Qwen2 is Llama with QKV biases and
(usually) untied output weights. Configs are passed to jitted functions as static
arguments, so they must stay hashable (tuples, not lists).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

from ssd_jax.models.forms import Forms


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer.

    Attributes:
      arch: "llama" or "qwen2" (informational; behaviour is set by the flags below).
      vocab_size: rows of the embedding / columns of the output head (may be padded
        beyond the tokenizer's vocabulary, e.g. 151936 for Qwen2.5).
      hidden_size: model width D.
      intermediate_size: SwiGLU hidden width F.
      num_layers: decoder blocks L.
      num_heads: query heads H.
      num_kv_heads: key/value heads (grouped-query attention); H % KVH == 0.
      head_dim: per-head width.
      rope_theta: RoPE base frequency.
      rope_scaling: optional Llama-3 frequency scaling.
      rms_norm_eps: epsilon inside RMSNorm.
      qkv_bias: whether q/k/v projections carry biases (Qwen2).
      tie_embeddings: output head shares the embedding matrix.
      max_position_embeddings: the context window.
      bos_token_id / eos_token_ids: special tokens (eos may be several ids).
      dtype: activation / weight dtype name ("float32" on CPU, "bfloat16" on accelerators).
      weight_dtype: the dtype the weight MATRICES are stored in when it differs from ``dtype``
        (None = ``dtype``): a draft computing in float32 on CPU with bfloat16 matrices streams
        half the bytes (``--draft-dtype``; the CPU kernel widens them in registers).
      forms: how each weight matrix is stored and contracted (``ssd_jax.models.forms``); the
        default is the checkpoint layout (out, in) with ``x @ W.T`` everywhere. Loaders set it
        per backend and transpose the stored tensors to match, once.
    """

    arch: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    forms: Forms = Forms()
    weight_dtype: str | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not divisible by num_kv_heads={self.num_kv_heads}")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    # --- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d.pop("forms")
        if d.get("weight_dtype") is None:  # absent = dtype (keeps older files and readers valid)
            d.pop("weight_dtype", None)
        if not self.forms.canonical:  # absent = checkpoint layout (keeps older files and readers valid)
            d["forms"] = self.forms.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        rs = d.get("rope_scaling")
        d["rope_scaling"] = RopeScaling(**rs) if rs else None
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["forms"] = Forms.from_dict(d.get("forms"))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (LlamaConfig / Qwen2Config)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r} (supported: llama, qwen2)")
        heads = hf["num_attention_heads"]
        # transformers >= 5 writes "rope_parameters" (theta + scaling in one dict); older
        # versions write "rope_theta" and "rope_scaling"
        rp = hf.get("rope_parameters") or {}
        theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
        rs = hf.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
        scaling = None
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            arch="qwen2" if model_type == "qwen2" else "llama",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype,
        )
