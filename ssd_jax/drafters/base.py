"""What every drafter returns, and the checks shared by draft models."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
    """The speculation a round verifies, per row (every drafter's output, and SSD's speculation)."""

    tokens: jax.Array  # (B, K) int32
    n_draft: jax.Array  # (B,) int32, real proposals per row (<= K)
    q: jax.Array | None  # (B, K, V) float32 log-probs (-inf rows = point masses), or None: all point masses
    hit: jax.Array | None = None  # SSD: (B,) bool, the speculation came from the speculation cache


def align_vocab(logits_BxV: jax.Array, vocab: int) -> jax.Array:
    """Pad (with -inf) or cut draft logits to the target's vocabulary size.

    Draft and target share a tokenizer but their embedding tables may be padded differently
    (e.g. 151936 vs 152064 rows): ids beyond the shorter table are padding no tokenizer emits.
    """
    v = logits_BxV.shape[-1]
    if v == vocab:
        return logits_BxV
    if v > vocab:
        return logits_BxV[..., :vocab]
    pad = jnp.full(logits_BxV.shape[:-1] + (vocab - v,), -jnp.inf, logits_BxV.dtype)
    return jnp.concatenate([logits_BxV, pad], axis=-1)


def check_same_tokenizer(target, draft) -> None:
    from ssd_jax.errors import UserError

    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None:
        if tt.fingerprint() != dt.fingerprint():
            raise UserError(
                f"draft {draft.name} and target {target.name} use different tokenizers; speculative decoding "
                "needs a shared vocabulary"
            )
    elif (tt is None) != (dt is None) or abs(target.cfg.vocab_size - draft.cfg.vocab_size) > 1024:
        raise UserError(f"cannot check that draft {draft.name} and target {target.name} share a tokenizer")
