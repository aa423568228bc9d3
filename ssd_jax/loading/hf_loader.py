"""Hugging Face model directories (config.json + *.safetensors, sharded or not).

Tensors are read one at a time with ``safetensors`` (numpy framework), converted to
float32 and mapped into our layout: HF linear weights are (out, in) and become (in, out)
with heads split out; HF checkpoints are not row-permuted (rotate-half RoPE).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ssd_jax.errors import UserError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import from_checkpoint

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TOP_MAP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_hf_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def hf_config(path: str | os.PathLike, dtype: str = "float32") -> ModelConfig:
    p = Path(path) / "config.json"
    try:
        with open(p) as f:
            raw = json.load(f)
        return ModelConfig.from_hf(raw, dtype=dtype)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot use {p}: {type(e).__name__}: {e}") from None


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files, in index order when a ``model.safetensors.index.json`` exists."""
    d = Path(path)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"cannot read {index}: {e}") from None
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise UserError(f"{d}: shard(s) {missing} listed in the index are missing")
        return [d / f for f in files]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors files in {d}")
    return files


def weights_sha256(path: str | os.PathLike) -> str:
    """sha256 over the safetensors files (name and content, in sorted order), streamed."""
    h = hashlib.sha256()
    for f in sorted(safetensors_files(path), key=lambda p: p.name):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _to_f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def iter_hf_tensors(path: str | os.PathLike, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (flat name, float32 array in our layout) one tensor at a time."""
    from safetensors import safe_open

    for f in safetensors_files(path):
        try:
            handle = safe_open(str(f), framework="numpy")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise UserError(f"cannot read {f}: {e}") from None
        with handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                try:
                    w = _to_f32(handle.get_tensor(name))
                except Exception as e:  # noqa: BLE001
                    raise UserError(f"cannot read tensor {name} from {f}: {e}") from None
                if name == "lm_head.weight" and cfg.tie_embeddings:
                    del w
                    continue
                if name in _TOP_MAP:
                    key = _TOP_MAP[name]
                else:
                    m = _LAYER_RE.match(name)
                    if not m or m.group(2) not in _LAYER_MAP:
                        raise UserError(f"unexpected tensor {name!r} in {f} (supported: Llama / Qwen2)")
                    key = f"layers.{int(m.group(1))}.{_LAYER_MAP[m.group(2)]}"
                try:
                    yield key, from_checkpoint(cfg, key, w)
                except ValueError as e:
                    raise UserError(f"{f}: {e}") from None
                del w


def read_hf(path: str | os.PathLike, dtype: str = "float32"):
    """Open an HF directory: returns (cfg, tensor iterator, Tokenizer | None)."""
    from ssd_jax.loading.tokenizer import Tokenizer

    cfg = hf_config(path, dtype)
    tok = Tokenizer.from_hf_dir(path) if (Path(path) / "tokenizer.json").is_file() else None
    if tok is not None:
        eos = tuple(dict.fromkeys(tok.eos_token_ids + cfg.eos_token_ids))
        tok.eos_token_ids = eos
        cfg = cfg.replace(eos_token_ids=eos)
    return cfg, iter_hf_tensors(path, cfg), tok
