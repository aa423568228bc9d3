"""The target's log-probabilities of emitted tokens (OpenAI's ``logprobs``), and the EOS ban of
``min_tokens``.

**Log-probabilities.** A request that asks for them gets, for every token it is given, the target's
log-probability of that token and its ``top`` most likely alternatives, from the target's raw logits
(``log_softmax`` before temperature, top-k and top-p: vLLM's default, ``raw_logprobs``). Every method
computes them where the token is chosen: the prefill (the first token), the AR round and the verify of
SD and SSD, whose logits are the target's distributions at each emitted position, so speculation
returns the same numbers as AR. Rounds compute them only when some running row asks (a static flag of
the round program), so nobody else pays for the log-softmax and the top-k over the vocabulary.

On the way to the host they ride in the round's one int32 array: :func:`pack` appends, per row, the
log-probabilities (float32 bit patterns), the top ids and the top log-probabilities; :func:`unpack`
reads them back. One transfer per round, as without them.

**min_tokens.** :func:`ban_early_eos` sets the banned ids' logits (the end-of-sequence ids) to -inf at
positions before a row's ``min_end`` (prompt length + ``min_tokens``), in the target's logits before
anything is sampled or verified, so the target distribution is the one vLLM's ``min_tokens`` defines and
speculation stays exact against it (a proposed EOS has target probability 0 and is rejected).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

#: the most alternatives a request may ask for (vLLM's default ``--max-logprobs``); rounds compute this
#: many and each request keeps its own number
MAX_LOGPROBS = 20


def token_logprobs(logits_xV: jax.Array, tokens_x: jax.Array, top: int = MAX_LOGPROBS):
    """(log p(token) (x...), top ids (x..., top) int32, top log-probabilities (x..., top)) from raw logits.
    Negative token ids (padding past a row's emitted tokens) read id 0; the host ignores them."""
    logp = jax.nn.log_softmax(logits_xV.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logp, jnp.maximum(tokens_x, 0)[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(logp, min(top, logp.shape[-1]))  # a vocabulary may be smaller
    return lp, top_ids.astype(jnp.int32), top_lp


def pack(lp_BxW: jax.Array, ids_BxWxT: jax.Array, top_BxWxT: jax.Array) -> jax.Array:
    """The three as int32 columns (B, W * (1 + 2T)) to append to a round's host array."""
    B = lp_BxW.shape[0]
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
    return jnp.concatenate([bits(lp_BxW), ids_BxWxT.reshape(B, -1), bits(top_BxWxT).reshape(B, -1)], axis=1)


def packed_width(w: int, vocab: int, top: int = MAX_LOGPROBS) -> int:
    return w * (1 + 2 * min(top, vocab))


def logprob_columns(logits_BxWxV: jax.Array, tokens_BxW: jax.Array) -> jax.Array:
    """:func:`token_logprobs` then :func:`pack`: what a round appends when a row asks."""
    return pack(*token_logprobs(logits_BxWxV, tokens_BxW))


@dataclasses.dataclass(frozen=True)
class HostLogprobs:
    """A round's log-probabilities on the host: per row and emitted position."""

    lp: np.ndarray  # (B, W) float32
    top_ids: np.ndarray  # (B, W, T) int32
    top_lp: np.ndarray  # (B, W, T) float32

    def token(self, b: int, j: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
        """Row ``b``'s ``j``-th emitted token: its log-probability and its ``n_top`` best alternatives."""
        return float(self.lp[b, j]), [
            (int(i), float(x)) for i, x in zip(self.top_ids[b, j, :n_top], self.top_lp[b, j, :n_top])
        ]


def unpack(cols: np.ndarray, w: int) -> HostLogprobs:
    """The inverse of :func:`pack` on the host (``cols``: the (B, packed_width(w, V)) int32 columns)."""
    cols = np.ascontiguousarray(cols, np.int32)
    B = cols.shape[0]
    top = (cols.shape[1] // w - 1) // 2
    lp = cols[:, :w].view(np.float32)
    ids = cols[:, w : w + w * top].reshape(B, w, top)
    tl = np.ascontiguousarray(cols[:, w + w * top :]).view(np.float32).reshape(B, w, top)
    return HostLogprobs(lp, ids, tl)


def ban_early_eos(logits_BxWxV: jax.Array, pos_BxW: jax.Array, min_end_B: jax.Array, ban_BxE: jax.Array):
    """``logits`` with each row's banned ids (``ban``, -1 = none) at -inf where the predicted token's
    position is before the row's ``min_end``. Rows without ``min_tokens`` have ``min_end`` 0: unchanged."""
    early = pos_BxW < min_end_B[:, None]  # (B, W)
    B, W, _ = logits_BxWxV.shape
    ids = jnp.broadcast_to(jnp.maximum(ban_BxE, 0)[:, None, :], (B, W, ban_BxE.shape[1]))
    hit = early[:, :, None] & (ban_BxE >= 0)[:, None, :]
    cur = jnp.take_along_axis(logits_BxWxV, ids, axis=-1)
    new = jnp.where(hit, -jnp.inf, cur).astype(logits_BxWxV.dtype)
    bi = jnp.arange(B)[:, None, None]
    wi = jnp.arange(W)[None, :, None]
    # a scatter-min: an unbanned entry (or the padding's id 0) writes back what it read, so repeated
    # ids cannot undo a ban
    return logits_BxWxV.at[bi, wi, ids].min(new)


def apply_min_tokens(logits_BxWxV: jax.Array, pos_BxW: jax.Array, rs) -> jax.Array:
    """:func:`ban_early_eos` with the rows' ``min_end`` and ``ban`` (``rs``: a ``RowSampling``); the logits
    themselves when the rows carry no ban (callers outside the engine)."""
    if rs.min_end is None:
        return logits_BxWxV
    return ban_early_eos(logits_BxWxV, pos_BxW, rs.min_end, rs.ban)


def columns_if_wanted(logits_BxWxV: jax.Array, tokens_BxW: jax.Array, rs) -> jax.Array:
    """The packed log-probabilities of ``tokens`` (B, packed_width(W)) when some row asks for them, zeros
    otherwise (``lax.cond``: the log-softmax and top-k over the vocabulary run only then); (B, 0) when the
    rows carry no ``want_logprobs`` (callers outside the engine)."""
    B, W = tokens_BxW.shape
    if rs.want_logprobs is None:
        return jnp.zeros((B, 0), jnp.int32)
    return jax.lax.cond(
        jnp.any(rs.want_logprobs),
        lambda: logprob_columns(logits_BxWxV, tokens_BxW),
        lambda: jnp.zeros((B, packed_width(W, logits_BxWxV.shape[-1])), jnp.int32),
    )


def host_logprobs(host: np.ndarray, start: int, w: int) -> HostLogprobs | None:
    """A round's log-probabilities from its host array, whose columns from ``start`` on are
    :func:`columns_if_wanted`'s for ``w`` emitted positions; None when it has none."""
    return unpack(host[:, start:], w) if host.shape[1] > start else None
