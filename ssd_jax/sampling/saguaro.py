"""Saguaro sampling (SSD paper, Definition 14): the draft distribution with its top-F tokens
down-weighted by C, so bonus tokens land in the speculation cache more often. The distribution
sampled from is what the verifier receives as q, so exactness is untouched.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ssd_jax.sampling.filters import RowSampling, categorical, filter_logprobs


def saguaro_logprobs(logprobs: jax.Array, fan: jax.Array, c: float, f_max: int) -> jax.Array:
    """σ_{F,C}: multiply the probability of each row's top-F tokens by C and renormalise.

    Args:
      logprobs: (..., V) filtered draft log-probabilities (-inf outside the support).
      fan: int array broadcastable to ``logprobs.shape[:-1]``, F per row / position (0 = off).
      c: the Saguaro constant in [0, 1] (static). 1 returns ``logprobs`` unchanged.
      f_max: static upper bound on F.
    A row whose whole support lies in its top-F set with C = 0 keeps its distribution (σ
    would be empty there).
    """
    if c >= 1.0 or f_max <= 0:
        return logprobs
    vals, idx = jax.lax.top_k(logprobs, f_max)
    in_set = jnp.arange(f_max) < jnp.asarray(fan)[..., None]
    log_c = math.log(c) if c > 0 else -jnp.inf
    new_vals = jnp.where(in_set & jnp.isfinite(vals), vals + log_c, vals)
    out = jnp.put_along_axis(logprobs, idx, new_vals, axis=-1, inplace=False)
    tot = jax.nn.logsumexp(out, axis=-1, keepdims=True)
    ok = jnp.isfinite(tot)
    return jnp.where(ok, out - jnp.where(ok, tot, 0.0), logprobs)


def draft_sample(key, logits, rs: RowSampling, fan, *, needs_filter, greedy, c, f_max):
    """Sample draft tokens from σ_{F,C} of the filtered logits; returns (tokens, logprobs | None).

    ``logits`` is (B, ..., V); greedy runs take the raw argmax and keep no distribution.
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    lp = saguaro_logprobs(filter_logprobs(logits, rs, needs_filter), fan, c, f_max)
    return categorical(key, lp).astype(jnp.int32), lp
