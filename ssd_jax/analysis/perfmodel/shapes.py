"""Model shapes for the performance model: the sizes of a decoder, never its weights.

:data:`MODEL_CONFIGS` holds the presets (our CPU models as ssd_jax loads them and the SSD
paper's Llama pair); :func:`model_shape` also understands ``<preset>-first-N-layers`` and a
trained draft's or converted model's directory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import count_params, weight_bytes_per_token


def _llama_8b() -> ModelConfig:
    return ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
    )


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
        return cls(
            name,
            count_params(cfg),
            weight_bytes_per_token(cfg, 1),
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.vocab_size,
        )

    def weight_bytes(self, itemsize: int) -> float:
        return float(self.weight_params) * itemsize

    def kv_bytes_per_token(self, itemsize: int) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * itemsize


MODEL_CONFIGS: dict[str, ModelConfig] = {
    # as loaded by ssd_jax (the GGUFs carry a separate output head); parameter counts match
    # experiments/results/ar_cpu.json
    "qwen2.5-coder-1.5b-instruct": ModelConfig(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        qkv_bias=True,
    ),
    "qwen2.5-coder-0.5b-instruct": ModelConfig(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        qkv_bias=True,
    ),
    "smollm2-135m-instruct": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        tie_embeddings=True,
    ),
    # the SSD paper's pair (published configs)
    "llama-3.1-70b": ModelConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        tie_embeddings=True,
    ),
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
    from ssd_jax.loading.draft import checkpoint_roots

    for d in (Path(name), Path("checkpoints") / name, *(r / name for r in checkpoint_roots())):
        for f in ("draft.json", "config.json"):
            if (d / f).is_file():
                cfg = json.loads((d / f).read_text())
                return ModelShape.from_config(name, ModelConfig.from_dict(cfg.get("config", cfg)))
    raise KeyError(f"unknown model {name!r}: add its config to MODEL_CONFIGS")
