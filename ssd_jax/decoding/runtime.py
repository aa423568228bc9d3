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
from ssd_jax.sampling.filters import fold_in, sample
from ssd_jax.sampling.logprobs import apply_min_tokens, columns_if_wanted


def ar_slot_round(params: Params, cache: KVCache, rows, active_B, *, cfg, needs_filter, greedy=False):
    """One AR step for every slot, each row from its own key at its own step (EOS banned before a row's
    ``min_tokens``). Returns (host array (B, 1 + log-probability columns): the tokens, then what
    :func:`~ssd_jax.sampling.logprobs.columns_if_wanted` gives; tokens (B,); cache; the rows' new steps).
    ``greedy`` (static): every live row is at temperature 0, so the token is the argmax (no draw)."""
    from ssd_jax.decoding.slots import park

    h, cache = llama.forward(params, cfg, rows.cur[:, None], cache)
    raw = llama.logits(params, cfg, h)  # (B, 1, V)
    lg = apply_min_tokens(raw, cache.lengths[:, None] + 1, rows.rs)[:, 0]  # cur sits at the old length
    if greedy:
        tok = jnp.argmax(lg, axis=-1).astype(jnp.int32)
    else:
        tok = sample(fold_in(rows.key_batch, rows.steps), lg, rows.rs, needs_filter)
    out = jnp.concatenate([tok[:, None], columns_if_wanted(raw, tok[:, None], rows.rs)], axis=1)
    cache = cache.with_lengths(cache.lengths + 1)
    return out, tok, park(cache, active_B), rows.steps + 1  # the rows' new cur is ``tok``


@functools.lru_cache(maxsize=64)
def ar_round_program(
    cfg: ModelConfig, needs_filter: bool, window: int | None, greedy: bool = False
) -> Compiled:
    from ssd_jax.decoding.slots import windowed

    fn = functools.partial(ar_slot_round, cfg=cfg, needs_filter=needs_filter, greedy=greedy)
    return Compiled(windowed(fn, window, cache_args=(1,)), donate_argnums=(1,), name=f"ar_round_w{window}")
