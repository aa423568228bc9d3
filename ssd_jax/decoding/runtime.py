"""The AR model steps (prefill, one-token decode) as ahead-of-time compiled programs
(:class:`ssd_jax.compile.Compiled`, re-exported here).

Ahead-of-time compiled model steps with static shapes.

Every device step of the engine (prefill, one-token decode, later draft and verify
rounds) is one jitted function of a frozen config. :class:`Compiled` lowers and compiles
it explicitly the first time a new set of argument shapes is seen, records how long that
took (reported as ``compile_s``), and afterwards calls the executable directly, so that a
generation loop can never recompile behind the user's back.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp


from ssd_jax.compile import Compiled
from ssd_jax.models import llama
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.llama import KVCache
from ssd_jax.models.params import Params
from ssd_jax.sampling.filters import RowSampling, fold_in, sample


# --- the AR steps ---------------------------------------------------------------------


def decode_step(params: Params, cache: KVCache, tokens_B, key, step, rs: RowSampling, *, cfg, needs_filter):
    """Append one token per row and sample the next one. ``key``, ``step``: one key and step, or per row
    (a (B,) batch of row keys and (B,) steps)."""
    h, cache = llama.forward(params, cfg, tokens_B[:, None], cache)
    lg = llama.logits(params, cfg, h[:, 0])
    tok = sample(fold_in(key, step), lg, rs, needs_filter)
    return tok, cache.with_lengths(cache.lengths + 1)


# --- the engine's AR round: every slot, each row from its own key at its own step


def ar_slot_round(params: Params, cache: KVCache, rows, active_B, *, cfg, needs_filter, greedy=False):
    """One AR step for every slot; returns (tokens (B,), cache, the rows' new steps).
    ``greedy`` (static): every live row is at temperature 0, so the token is the argmax (no draw)."""
    from ssd_jax.decoding.slots import park

    if greedy:
        h, cache = llama.forward(params, cfg, rows.cur[:, None], cache)
        tok = jnp.argmax(llama.logits(params, cfg, h[:, 0]), axis=-1).astype(jnp.int32)
        cache = cache.with_lengths(cache.lengths + 1)
    else:
        tok, cache = decode_step(
            params, cache, rows.cur, rows.key_batch, rows.steps, rows.rs, cfg=cfg, needs_filter=needs_filter
        )
    return tok, park(cache, active_B), rows.steps + 1  # the rows' new cur is ``tok``


@functools.lru_cache(maxsize=64)
def ar_round_program(
    cfg: ModelConfig, needs_filter: bool, window: int | None, greedy: bool = False
) -> Compiled:
    from ssd_jax.decoding.slots import windowed

    fn = functools.partial(ar_slot_round, cfg=cfg, needs_filter=needs_filter, greedy=greedy)
    return Compiled(windowed(fn, window, cache_args=(1,)), donate_argnums=(1,), name=f"ar_round_w{window}")
