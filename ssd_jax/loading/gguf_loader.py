"""GGUF files (llama / qwen2 architectures) -> ModelConfig and float32 tensors in our layout.

Tensors are dequantised one at a time with ``gguf.quants.dequantize``. The numpy shape of a
GGUF tensor is the reverse of its GGUF shape, i.e. (out, in), which is our layout too; only
the head axes are split out. Llama-arch files have the rows of attn_q / attn_k permuted per head by
llama.cpp's converter (for its interleaved RoPE); :func:`unpermute_rows` undoes that so the
weights match rotate-half RoPE. Qwen2 files are not permuted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from ssd_jax.errors import UserError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import from_checkpoint

SUPPORTED_ARCHS = ("llama", "qwen2")
# dequantise at most this many elements at once (bounds the temporaries of a big tensor)
_CHUNK_ELEMS = 1 << 24

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_TOP_MAP = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_LAYER_MAP = {
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
# tensors that carry no weights we use
_SKIP = ("rope_freqs.weight",)


def open_gguf(path: str | os.PathLike):
    """``gguf.GGUFReader`` for ``path``; unreadable or corrupt files raise UserError."""
    import gguf

    if not os.path.isfile(path):
        raise UserError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - the reader raises assorted errors on bad input
        raise UserError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def metadata(reader, keys: list[str] | None = None) -> dict[str, Any]:
    """Metadata key -> python value (strings, numbers, lists) for ``keys`` (default: all)."""
    out = {}
    for k, field in reader.fields.items():
        if keys is not None and k not in keys:
            continue
        try:
            out[k] = field.contents()
        except Exception as e:  # noqa: BLE001
            raise UserError(f"GGUF metadata field {k} is unreadable ({type(e).__name__}: {e})") from None
    return out


def tokenizer_metadata(reader) -> dict[str, Any]:
    return metadata(reader, [k for k in reader.fields if k.startswith("tokenizer.")])


def _tensor_index(reader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def config_from_gguf(reader, dtype: str = "float32", tokenizer=None) -> ModelConfig:
    """ModelConfig from GGUF metadata (``<arch>.*`` keys) and tensor shapes.

    ``tokenizer`` (if given) supplies the eos ids, so that end-of-turn tokens such as
    ``<|im_end|>`` count as EOS next to ``tokenizer.ggml.eos_token_id``.
    """
    small = [k for k in reader.fields if not k.startswith("tokenizer.ggml.") or k.endswith("_id")]
    md = metadata(reader, small)
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UserError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full in md:
            return md[full]
        if required and default is None:
            raise UserError(f"GGUF file lacks metadata {full}")
        return default

    tensors = _tensor_index(reader)
    scaling = get("rope.scaling.type", "none", required=False)
    if scaling not in ("none", None) or "rope_freqs.weight" in tensors:
        raise UserError(f"GGUF RoPE scaling ({scaling!r}, rope_freqs) is not supported")
    D = int(get("embedding_length"))
    H = int(get("attention.head_count"))
    KVH = int(get("attention.head_count_kv", H, required=False))
    head_dim = int(get("attention.key_length", D // H, required=False))
    if "token_embd.weight" not in tensors:
        raise UserError("GGUF file has no token_embd.weight tensor")
    # numpy shape of a GGUF tensor is the reverse of the GGUF shape: (V, D) here
    vocab = int(tensors["token_embd.weight"].shape[-1])
    eos_ids: tuple[int, ...] = ()
    if tokenizer is not None:
        eos_ids = tokenizer.eos_token_ids
    elif md.get("tokenizer.ggml.eos_token_id") is not None:
        eos_ids = (int(md["tokenizer.ggml.eos_token_id"]),)
    bos = md.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=D,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=H,
        num_kv_heads=KVH,
        head_dim=head_dim,
        rope_theta=_f32(get("rope.freq_base", 10000.0, required=False)),
        rope_scaling=None,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        max_position_embeddings=int(get("context_length", 4096, required=False)),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos_ids),
        dtype=dtype,
    )


def _f32(x: Any) -> float:
    """GGUF stores float32: 9.999999747e-06 -> 1e-05 (shortest decimal of the float32)."""
    return float(str(np.float32(x)))


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's row permutation of q/k (rotate-half -> interleaved pairs)."""
    out = w.shape[0]
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_rows` (works on (out, in) matrices and (out,) biases)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """float32 numpy array of a ``ReaderTensor``, shape = reversed GGUF shape."""
    import gguf

    qtype = tensor.tensor_type
    data = tensor.data
    shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.array(data, dtype=np.float32).reshape(shape)
    if data.ndim < 2 or data.shape[0] * shape[-1] <= _CHUNK_ELEMS:
        return gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False).reshape(shape)
    # dequantise row blocks into one preallocated output to bound temporaries
    rows = data.reshape(-1, data.shape[-1])
    out = np.empty((rows.shape[0], shape[-1]), dtype=np.float32)
    step = max(1, _CHUNK_ELEMS // shape[-1])
    for i in range(0, rows.shape[0], step):
        out[i : i + step] = gguf.quants.dequantize(rows[i : i + step], qtype)
    return out.reshape(shape)


def iter_gguf_tensors(reader, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (flat name, float32 array in our layout) one tensor at a time."""
    H, KVH = cfg.num_heads, cfg.num_kv_heads
    permuted = cfg.arch == "llama"
    for t in reader.tensors:
        name = t.name
        if name in _SKIP:
            continue
        try:
            w = dequantize(t)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"GGUF tensor {name} cannot be decoded ({type(e).__name__}: {e})") from None
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        if name in _TOP_MAP:
            key = _TOP_MAP[name]
        else:
            m = _LAYER_RE.match(name)
            if not m or m.group(2) not in _LAYER_MAP:
                raise UserError(f"unexpected GGUF tensor {name!r} for architecture {cfg.arch}")
            ours = _LAYER_MAP[m.group(2)]
            key = f"layers.{int(m.group(1))}.{ours}"
            if permuted and ours in ("wq", "wk", "bq", "bk"):
                w = unpermute_rows(w, H if ours in ("wq", "bq") else KVH)
        try:
            out = from_checkpoint(cfg, key, w)
        except ValueError as e:
            raise UserError(f"GGUF tensor {name}: {e}") from None
        del w
        yield key, out


def read_gguf(path: str | os.PathLike, dtype: str = "float32"):
    """Open ``path``: returns (cfg, tensor iterator, Tokenizer | None, warnings).

    The tokenizer is ``None`` (with a warning string) when the GGUF tokenizer kind is
    not one this package can rebuild.
    """
    from ssd_jax.loading.tokenizer import Tokenizer

    reader = open_gguf(path)
    warnings: list[str] = []
    tok = None
    try:
        tok = Tokenizer.from_gguf_metadata(tokenizer_metadata(reader))
    except (ValueError, KeyError) as e:
        warnings.append(f"no tokenizer rebuilt from {path}: {e}")
    cfg = config_from_gguf(reader, dtype=dtype, tokenizer=tok)
    return cfg, iter_gguf_tensors(reader, cfg), tok, warnings
