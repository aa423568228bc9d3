"""Llama / Qwen2 decoder forward pass over an explicit parameter pytree and KV cache.

One function, :func:`forward`, serves every use:

* prefill      - T prompt tokens per row (right-padded; padding is written but never read),
* decode       - T = 1,
* verification - T = K + 1 tokens appended at each row's own offset,
* tree decode  - arbitrary RoPE positions, cache slots and attention mask (SSD branches).

The KV cache is static-shape, ``(B, S, KVH, hd)`` per layer, with a length per row. New
keys and values are scattered into slots ``lengths[b] + t`` (out-of-range writes are
dropped, never clamped); a query at slot ``s`` sees slots ``<= s``. Rolling back rejected
speculative tokens is just resetting a row's length: stale slots beyond the length are
overwritten before anything can attend to them.

Normalisation, softmax and logits are computed in float32 whatever the weight dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ssd_jax.models import forms as F
from ssd_jax.models import kernels
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer key/value buffers ``(B, S, KVH, hd)`` plus the valid length of each row.

    ``window`` (static, default None = all S slots): attention reads only the first ``window``
    slots. The caller guarantees that every slot a query writes or may see lies below it; the
    server sets it per round from a few context-length buckets, so a step costs what the longest
    running context needs rather than what ``--max-model-len`` allows (on XLA:CPU an 8-row SmolLM2
    step at context 200 costs 86 ms with a 256-slot window, 162 ms over 1024 slots).

    ``lengths`` may cover only the first rows of the buffers (a batch bucket: :func:`bucket_view`):
    :func:`forward` then runs those rows only, writing their keys and values in place.

    Paged (``pages`` set, :func:`init_paged_cache`): the buffers are a pool of blocks ``(N, bs, KVH,
    hd)`` and ``pages`` (B, P) is each row's block table: slot ``s`` of row ``b`` lives at block
    ``pages[b, s // bs]``, offset ``s % bs``. An entry ``N`` (or beyond) is no block: writes there are
    dropped (a free row, or slots past what a row was given). Rows share blocks by naming the same
    ones (a cached prompt prefix, ``ssd_jax.engine.blocks``); a row in a bucket, a prefill of some
    rows, a window: a view of the table, never a copy of keys and values.

    ``start`` (B,), optional: each row attends to its slots from ``start`` on only (a draft that sees just
    the last tokens of its prompt, ``SpecConfig.draft_context``); the slots below may hold anything."""

    k: list[jax.Array]
    v: list[jax.Array]
    lengths: jax.Array  # (B,) int32
    window: int | None = dataclasses.field(default=None, metadata={"static": True})
    pages: jax.Array | None = None  # (B, P) int32 block table of a paged cache
    start: jax.Array | None = None  # (B,) int32 first visible slot of each row (None: 0)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def block_size(self) -> int | None:
        return None if self.pages is None else self.k[0].shape[1]

    @property
    def max_len(self) -> int:
        if self.pages is not None:
            return self.pages.shape[1] * self.k[0].shape[1]
        return self.k[0].shape[1]

    @property
    def is_view(self) -> bool:
        """A paged pool or a batch bucket's rows of larger buffers: XLA:CPU copies a conditional's operand
        buffers whole, so a ``lax.cond`` over such a cache copies every layer's keys and values."""
        return self.pages is not None or self.batch_size < self.k[0].shape[0]

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def with_window(self, window: int | None) -> KVCache:
        return dataclasses.replace(self, window=window)


def bucket_view(cache: KVCache | None, b: int | None) -> KVCache | None:
    """The first ``b`` rows of ``cache`` (their lengths; the buffers stay whole, so writes land in place);
    ``b`` None: the cache itself."""
    if cache is None or b is None:
        return cache
    pages = None if cache.pages is None else cache.pages[:b]
    start = None if cache.start is None else cache.start[:b]
    return KVCache(cache.k, cache.v, cache.lengths[:b], cache.window, pages, start)


def bucket_merge(full: KVCache | None, part: KVCache | None, b: int | None) -> KVCache | None:
    """``part`` (a :func:`bucket_view` after a step) back as the whole cache: its buffers, the first ``b``
    lengths replaced."""
    if full is None or b is None:
        return part
    start = None if full.start is None else full.start.at[:b].set(part.start)
    return KVCache(part.k, part.v, full.lengths.at[:b].set(part.lengths), part.window, full.pages, start)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dtype = dtype or cfg.jnp_dtype
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def init_paged_cache(cfg: ModelConfig, batch: int, max_len: int, n_blocks: int, block_size: int, dtype=None):
    """A paged cache: a pool of ``n_blocks`` blocks of ``block_size`` slots per layer, and a block table
    of ``ceil(max_len / block_size)`` entries per row, every entry empty (``n_blocks``)."""
    dtype = dtype or cfg.jnp_dtype
    shape = (n_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    per_row = -(-max_len // block_size)
    return KVCache(
        k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        lengths=jnp.zeros((batch,), jnp.int32),
        pages=jnp.full((batch, per_row), n_blocks, jnp.int32),
    )


def paged_write(
    pool: jax.Array, pages: jax.Array, slots_BxT: jax.Array, x_BxTxKVHxhd: jax.Array
) -> jax.Array:
    """Write ``x`` at each row's ``slots`` through its block table (slots without a block: dropped)."""
    bs = pool.shape[1]
    blk = jnp.take_along_axis(pages, slots_BxT // bs, axis=1, mode="fill", fill_value=pool.shape[0])
    return pool.at[blk, slots_BxT % bs].set(x_BxTxKVHxhd.astype(pool.dtype), mode="drop")


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse RoPE frequencies, with Llama-3 frequency-dependent scaling if configured."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    scaled = jnp.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return jnp.where(medium, blended, scaled)


def apply_rope(x_BxTxNxh: jax.Array, positions_BxT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face convention)."""
    ang = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # (B, T, hd/2)
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    x = x_BxTxNxh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxh.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def matmul(
    x: jax.Array, w: jax.Array, form: F.Form = F.CHECKPOINT_FORM, out_dim: int | None = None
) -> jax.Array:
    """``x @ W.T`` for a weight W declared (out, in) and stored as ``form`` says (``ssd_jax.models.forms``).

    ``out_dim`` flattens a stored multi-axis weight (e.g. wq (H, hd, D)) to 2-D first: free reshapes.
    """
    if out_dim is not None:
        w = w.reshape(out_dim, -1) if form.layout == "oi" else w.reshape(-1, out_dim)
    return F.apply(x, w, form)


def embed_tokens(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Embedding rows of ``tokens``; a tied embedding stored (D, V) (head form "io") is read by column."""
    if cfg.tie_embeddings and cfg.forms.head.layout == "io":
        return jnp.moveaxis(jnp.take(params["embed"], tokens, axis=1), 0, -1)
    return params["embed"][tokens]


def causal_slot_mask(slots_BxT: jax.Array, max_len: int) -> jax.Array:
    """Default mask: a query written at slot s sees every cache slot <= s."""
    return jnp.arange(max_len)[None, None, :] <= slots_BxT[:, :, None]


def _attention(
    layer, cfg: ModelConfig, x, positions, slots, mask, k_cache, v_cache, inv_freq, window=None, pages=None
):
    B, T, _ = x.shape
    H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    D = x.shape[-1]
    fm = cfg.forms
    # 2-D matmuls over free reshapes of the stored weights
    q = matmul(x, layer["wq"], fm.q, H * hd).reshape(B, T, H, hd)
    k = matmul(x, layer["wk"], fm.k, KVH * hd).reshape(B, T, KVH, hd)
    v = matmul(x, layer["wv"], fm.v, KVH * hd).reshape(B, T, KVH, hd)
    if cfg.qkv_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    G = H // KVH
    q = q.reshape(B, T, KVH, G, hd)
    mask = mask if window is None else mask[..., :window]
    scale = 1.0 / math.sqrt(hd)
    if pages is not None:  # a paged cache: write and read through the rows' block tables
        k_cache, v_cache = paged_write(k_cache, pages, slots, k), paged_write(v_cache, pages, slots, v)
        out = kernels.paged_attention(q, k_cache, v_cache, pages, mask, scale)
        return matmul(out.reshape(B, T, H * hd), layer["wo"], fm.o, D), k_cache, v_cache
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    k_cache = k_cache.at[rows, slots].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, slots].set(v.astype(v_cache.dtype), mode="drop")
    # over the first B rows (a batch bucket) and ``window`` slots of the whole cache, written in place
    # above: the CPU kernel for a few new tokens (float32, one device), else XLA's einsums
    out = kernels.attention(q, k_cache, v_cache, mask, scale)
    return matmul(out.reshape(B, T, H * hd), layer["wo"], fm.o, D), k_cache, v_cache


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens_BxT: jax.Array,
    cache: KVCache,
    *,
    positions_BxT: jax.Array | None = None,
    slots_BxT: jax.Array | None = None,
    mask_BxTxS: jax.Array | None = None,
    embeds_BxTxD: jax.Array | None = None,
    capture: tuple[int, ...] = (),
):
    """Run the decoder over T new tokens per row; returns final hidden states and the cache.

    By default token t of row b goes to slot ``cache.lengths[b] + t`` with that RoPE
    position and a causal mask. The returned cache has the new keys/values written but the
    SAME lengths: callers decide how many of the T tokens to keep (see KVCache.with_lengths).

    ``embeds_BxTxD``: the first layer's input instead of the tokens' embeddings (an EAGLE head,
    ``ssd_jax.drafters.eagle``). ``capture`` (static): layer indices whose outputs (the residual
    stream after that layer) are returned too, concatenated: then (hidden, cache, (B, T, n·D)).
    """
    B, T = tokens_BxT.shape
    if slots_BxT is None:
        slots_BxT = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    if positions_BxT is None:
        positions_BxT = slots_BxT
    if mask_BxTxS is None:
        mask_BxTxS = causal_slot_mask(slots_BxT, cache.max_len)
        if cache.start is not None:  # a row's slots below its start are hidden
            mask_BxTxS = mask_BxTxS & (jnp.arange(cache.max_len)[None, None, :] >= cache.start[:, None, None])
    inv_freq = rope_inv_freq(cfg)
    x = embed_tokens(params, cfg, tokens_BxT) if embeds_BxTxD is None else embeds_BxTxD
    x = x.astype(cfg.jnp_dtype)
    new_k, new_v, feats = [], [], []
    for i, layer in enumerate(params["layers"]):
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        a, kc, vc = _attention(
            layer,
            cfg,
            h,
            positions_BxT,
            slots_BxT,
            mask_BxTxS,
            cache.k[i],
            cache.v[i],
            inv_freq,
            cache.window,
            cache.pages,
        )
        new_k.append(kc)
        new_v.append(vc)
        x = x + a
        h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
        g = matmul(h, layer["w_gate"], cfg.forms.gate)
        u = matmul(h, layer["w_up"], cfg.forms.up)
        x = x + matmul(jax.nn.silu(g) * u, layer["w_down"], cfg.forms.down)
        if i in capture:
            feats.append(x)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    cache = dataclasses.replace(cache, k=new_k, v=new_v)
    if capture:
        return x, cache, jnp.concatenate(feats, axis=-1)
    return x, cache


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Output head in float32: ``(..., D) -> (..., V)``."""
    if "head_ids" in params:
        return trimmed_logits(params, cfg, hidden)
    w = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    return F.apply(hidden, w, cfg.forms.head, preferred_element_type=jnp.float32)


def head_rows(params: Params, cfg: ModelConfig, ids_N: jax.Array) -> jax.Array:
    """The output head's rows for token ids ``ids_N`` in the head's stored layout (``(N, D)`` rows or
    ``(D, N)`` columns): what a head trimmed to those ids multiplies by."""
    src = params["embed"] if cfg.tie_embeddings else params["lm_head"]
    return jnp.take(src, ids_N, axis=0 if cfg.forms.head.layout == "oi" else 1)


def kept_logits(params: Params, cfg: ModelConfig, hidden: jax.Array, ids_N: jax.Array) -> jax.Array:
    """Logits of the ``ids_N`` rows of the output head only, ``(..., N)`` in float32 (N/V of the cost)."""
    return F.apply(hidden, head_rows(params, cfg, ids_N), cfg.forms.head, preferred_element_type=jnp.float32)


def trimmed_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """A trimmed output head (draft vocabulary trimming, ``ssd_jax.drafters.vocab``).

    ``params["head"]`` holds N rows of the head (in the head's stored layout) for the token ids
    ``params["head_ids"]`` (N,); the result is still ``(..., V)``, -inf outside the kept ids, so
    the softmax (the draft's q) is 0 there and the tokens are never proposed.
    """
    kept = F.apply(hidden, params["head"], cfg.forms.head, preferred_element_type=jnp.float32)
    full = jnp.full(kept.shape[:-1] + (cfg.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., params["head_ids"]].set(kept)
