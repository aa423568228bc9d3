"""Sampling: temperature, top-k, top-p and greedy, per row, in float32.

:func:`filter_logprobs` turns raw logits into the log-probabilities that are actually sampled
from. Speculative verification must apply the SAME transform to target and draft logits
(exactness depends on it), so every sampler in the project goes through this one function.

Conventions (those of Hugging Face ``generate`` and vLLM):
* temperature 0 means greedy (argmax, ties broken towards the lowest token id);
* top_k 0 disables top-k; top_p 1.0 disables top-p;
* top-k is applied first, then top-p on the renormalised top-k distribution; a token is
  kept if the probability mass strictly before it (in descending order) is < top_p, so the
  most likely token is always kept;
* tokens tied with the last kept one are kept too (Hugging Face's top-k warper and vLLM do
  the same), so the kept set does not depend on how a sort orders ties.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import UserError

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. Defaults are greedy decoding (as in Hugging Face ``generate``).

    Attributes:
      temperature: 0 for greedy; > 0 divides the logits.
      top_k: keep the k most likely tokens (0 = all).
      top_p: nucleus sampling mass in (0, 1] (1 = all).
      seed: PRNG seed; a fixed seed reproduces the output exactly.
      max_new_tokens: generation budget per sequence.
      stop: stop strings; generation of a row ends when its text contains one (the text is
        cut before it, the token ids keep the token that completed it).
      ignore_eos: keep generating after an end-of-sequence token.
      n: samples per prompt, run as one batch.
      min_tokens: no end-of-sequence token (and no stop string) before this many new tokens: the
        target's EOS logits are set to -inf until then (vLLM's ``min_tokens``), so speculation stays
        exact against that distribution.
      logprobs: None, or return each emitted token's log-probability under the target (raw logits,
        before temperature and filters) with this many most likely alternatives (0 to 20).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    min_tokens: int = 0
    logprobs: int | None = None

    def validate(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise UserError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise UserError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise UserError(
                f"min-tokens must be in [0, max-new-tokens = {self.max_new_tokens}], got {self.min_tokens}"
            )
        from ssd_jax.sampling.logprobs import MAX_LOGPROBS

        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise UserError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
    """Per-row sampling parameters as device arrays (so they never trigger recompiles)."""

    temperature: jax.Array  # (B,) float32, 0 = greedy
    top_k: jax.Array  # (B,) int32, 0 = off
    top_p: jax.Array  # (B,) float32, 1 = off
    # the engine's rows also carry these (None elsewhere: no ban, no log-probabilities):
    min_end: jax.Array | None = None  # (B,) int32: no banned id at a position before it (min_tokens)
    ban: jax.Array | None = None  # (B, E) int32: the ids min_tokens bans (the EOS ids), -1 = none
    want_logprobs: jax.Array | None = None  # (B,) bool: the row asks for log-probabilities

    @classmethod
    def broadcast(cls, sp: SamplingParams, batch: int) -> RowSampling:
        return cls(
            temperature=jnp.full((batch,), sp.temperature, jnp.float32),
            top_k=jnp.full((batch,), sp.top_k, jnp.int32),
            top_p=jnp.full((batch,), sp.top_p, jnp.float32),
        )


CANDIDATES = 1024
"""Top-k / top-p look for their cutoff among each row's ``CANDIDATES`` largest logits (``lax.top_k``,
a partial sort) and fall back to a full sort only when some row's cutoff lies beyond them (top-k
above ``CANDIDATES``, or a nucleus wider than that). A full sort of a 49k-token vocabulary costs
~20 ms per row on XLA:CPU, ``lax.top_k`` of 1024 well under 1 ms."""


def _cutoff(xs, k, top_p, log_z):
    """The smallest kept value of rows whose values ``xs (..., C)`` are sorted descending.

    ``k`` (..., 1): top-k (<= 0 off); ``top_p`` (..., 1); ``log_z`` (..., 1): log of the softmax
    denominator of the top-k-restricted row. Returns (cutoff (..., 1), resolved (...,)): resolved is
    False where the kept prefix may extend past the C values given."""
    C = xs.shape[-1]
    rank = jnp.arange(C)
    in_k = (k <= 0) | (rank < k)
    ps = jnp.where(in_k, jnp.exp(xs - log_z), 0.0)
    mass_before = jnp.cumsum(ps, axis=-1) - ps
    # top_p = 1 keeps everything (a float32 cumsum can reach 1 before the tail ends)
    keep = in_k & ((top_p >= 1.0) | (mass_before < top_p))
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)  # a prefix: at least the top token
    cut = jnp.take_along_axis(xs, n_keep - 1, axis=-1)
    cut = jnp.where((k <= 0) & (top_p >= 1.0), NEG_INF, cut)  # no filter on this row
    # a top-k beyond C needs its own denominator and prefix: never resolved from C values
    resolved = ((n_keep < C) | ((k > 0) & (top_p >= 1.0))) & (k <= C)
    return cut, (resolved | ((k <= 0) & (top_p >= 1.0)))[..., 0]


def filter_logprobs(
    logits_BxV: jax.Array, rs: RowSampling, needs_filter: bool, candidates: int | None = None
) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p (float32, -inf outside support).

    Greedy rows (temperature 0) get the logits at temperature 1; callers take the argmax.
    ``needs_filter`` is static: when no row uses top-k/top-p no cutoff is computed.
    Works on ``(B, V)`` or ``(B, ..., V)`` logits (row parameters broadcast over the middle).

    The kept set of a row is every token whose (tempered) logit is >= the row's cutoff: the value
    of the last token of the top-k / top-p prefix in descending order. Tokens tied with it are
    all kept (as Hugging Face's top-k warper and vLLM do), so the result does not depend on how a
    sort orders ties. ``candidates`` (default :data:`CANDIDATES`) sets the partial sort's width.
    """
    x = logits_BxV.astype(jnp.float32)
    extra = x.ndim - 2
    expand = (slice(None),) + (None,) * extra
    temp = jnp.where(rs.temperature > 0, rs.temperature, 1.0)[expand][..., None]
    x = x / temp
    if needs_filter:
        V = x.shape[-1]
        C = min(V, CANDIDATES if candidates is None else candidates)
        k = rs.top_k[expand][..., None]
        top_p = rs.top_p[expand][..., None]
        full_z = jax.nn.logsumexp(x, axis=-1, keepdims=True)

        def from_sorted(xs):
            in_k = (k > 0) & (k <= xs.shape[-1])
            z_k = jax.nn.logsumexp(
                jnp.where(jnp.arange(xs.shape[-1]) < k, xs, NEG_INF), axis=-1, keepdims=True
            )
            return _cutoff(xs, k, top_p, jnp.where(in_k, z_k, full_z))

        cand = jax.lax.top_k(x, C)[0] if C < V else -jnp.sort(-x, axis=-1)
        cut, resolved = from_sorted(cand)
        if C < V:
            cut = jax.lax.cond(jnp.all(resolved), lambda: cut, lambda: from_sorted(-jnp.sort(-x, axis=-1))[0])
        x = jnp.where(x >= cut, x, NEG_INF)
    return jax.nn.log_softmax(x, axis=-1)


def is_key_batch(key: jax.Array) -> bool:
    """True for a (B,) batch of keys, False for a single key (typed ``jax.random.key`` or raw uint32)."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    return key.ndim == (1 if typed else 2)


def fold_in(key: jax.Array, data) -> jax.Array:
    """``jax.random.fold_in`` for one key, or row by row for a (B,) batch of row keys (``data`` a scalar
    or (B,)): the samplers take either, so a server can give each request its own key stream."""
    if not is_key_batch(key):
        return jax.random.fold_in(key, data)
    data = jnp.broadcast_to(jnp.asarray(data, jnp.uint32), key.shape[:1])
    return jax.vmap(jax.random.fold_in)(key, data)


def split(key: jax.Array, n: int) -> jax.Array:
    """``n`` keys along a new leading axis: ``jax.random.split`` of one key, or of each row key of a (B,)
    batch (then (n, B): element d of row b comes from row b's key alone)."""
    if not is_key_batch(key):
        return jax.random.split(key, n)
    return jax.vmap(lambda kb: jax.random.split(kb, n), out_axes=1)(key)


def categorical(key: jax.Array, logp: jax.Array) -> jax.Array:
    """``jax.random.categorical`` over the last axis of ``logp`` (B, ..., V); with a (B,) batch of row keys,
    row b draws from its own key only."""
    if is_key_batch(key):
        return jax.vmap(lambda k, lp: jax.random.categorical(k, lp, axis=-1))(key, logp)
    return jax.random.categorical(key, logp, axis=-1)


def sample(key: jax.Array, logits_BxV: jax.Array, rs: RowSampling, needs_filter: bool) -> jax.Array:
    """One token per row: argmax for greedy rows, a draw from the filtered distribution otherwise.

    ``key``: one key for the batch, or a (B,) batch of row keys; row b's draw then depends only on
    its own key (the same draw as a batch of one with that key)."""
    greedy = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    lp = filter_logprobs(logits_BxV, rs, needs_filter)
    drawn = categorical(key, lp)
    return jnp.where(rs.temperature > 0, drawn.astype(jnp.int32), greedy)
