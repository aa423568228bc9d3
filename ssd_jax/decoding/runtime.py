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


from ssd_jax.compile import Compiled, program_factory
from ssd_jax.models import llama
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.llama import KVCache
from ssd_jax.models.params import Params
from ssd_jax.sampling.filters import fold_in, sample
from ssd_jax.sampling.logprobs import apply_min_tokens, columns_if_wanted


def ar_slot_round(
    params: Params, cache: KVCache, rows, active_B, *, cfg, needs_filter, greedy=False, bucket=None
):
    """One AR step for every slot, each row from its own key at its own step (EOS banned before a row's
    ``min_tokens``). Returns (host array (B, 1 + log-probability columns): the tokens, then what
    :func:`~ssd_jax.sampling.logprobs.columns_if_wanted` gives; tokens (B,); cache; the rows' new steps).
    ``greedy`` (static): every live row is at temperature 0, so the token is the argmax (no draw).
    ``bucket`` (static): only the first ``bucket`` slots run (every running row is among them)."""
    from ssd_jax.decoding.slots import pad_rows, park, put_rows, take_rows

    r = take_rows(rows, bucket)
    h, part = llama.forward(params, cfg, r.cur[:, None], llama.bucket_view(cache, bucket))
    raw = llama.logits(params, cfg, h)  # (b, 1, V)
    lg = apply_min_tokens(raw, part.lengths[:, None] + 1, r.rs)[:, 0]  # cur sits at the old length
    if greedy:
        tok = jnp.argmax(lg, axis=-1).astype(jnp.int32)
    else:
        tok = sample(fold_in(r.key_batch, r.steps), lg, r.rs, needs_filter)
    out = jnp.concatenate([tok[:, None], columns_if_wanted(raw, tok[:, None], r.rs)], axis=1)
    cache = llama.bucket_merge(cache, part.with_lengths(part.lengths + 1), bucket)
    cur, steps = put_rows((rows.cur, rows.steps), (tok, r.steps + 1), bucket)
    return pad_rows(out, rows.cur.shape[0]), cur, park(cache, active_B), steps  # the rows' new cur is ``cur``


@program_factory
def ar_round_program(
    cfg: ModelConfig, needs_filter: bool, window: int | None, greedy: bool = False, bucket: int | None = None
) -> Compiled:
    from ssd_jax.decoding.slots import windowed

    fn = functools.partial(ar_slot_round, cfg=cfg, needs_filter=needs_filter, greedy=greedy, bucket=bucket)
    return Compiled(
        windowed(fn, window, cache_args=(1,)), donate_argnums=(1,), name=f"ar_round_w{window}_b{bucket}"
    )
