"""K = 0 rounds of SD with a draft model: a plain AR round with the draft left idle, and the draft's
catch-up when speculation resumes.

When K auto expects no K to pay at the running batch size (:class:`~ssd_jax.planning.policy.KPlan`
with ``zero``), the engine runs AR rounds. Feeding the draft each new token as well would make such a
round cost ``t_ar + t_draft_step``, more than AR. Instead the round only records, per row, the tokens
the draft has not seen (a small device buffer, ``lag`` (B, LAG_MAX) with counts ``lag_n``), and before
the next round with K > 0 one draft forward over the recorded tokens brings its cache level with the
target's (:func:`draft_flush`, a prefill at each row's own offset).

The draft's cache convention (:mod:`ssd_jax.decoding.sd`): its length equals the target's, the token
at the last slot (``prev``) possibly not yet written (the catch-up of a round whose K proposals were
all accepted). So a row's first K = 0 round records ``[prev, cur]`` and later ones ``cur``; the flush
writes them from slot ``length - 1`` on, rewriting ``prev``'s slot with ``prev`` itself. The host
never waits: it counts the K = 0 rounds since the last flush (each emits one token per running row),
which bounds every row's count, and flushes before the buffer could overflow.

SSD's draft keeps a different convention (every slot below its length written, ``cur`` not yet):
its AR rounds (``with_prev=False``) record ``cur`` alone and its flush (``back=0``) writes from the
draft's own length (:func:`ssd_jax.decoding.ssd.rounds.catch_up_slot`).

Exact whatever the schedule: the draft only proposes, and K is a function of earlier rounds only.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from ssd_jax.compile import Compiled, program_factory
from ssd_jax.decoding import runtime
from ssd_jax.drafters.model import draft_prefill
from ssd_jax.models import llama

#: tokens a row's lag buffer holds: a flush is forced before a K = 0 round would overflow it. The flush
#: is one program per batch bucket, over all of them and the whole cache (it runs once per switch back
#: to speculation: fewer programs to compile matter more than its cost)
LAG_MAX = 32


def sd_lag_round(
    tparams,
    tcache,
    rows,
    catch_up,
    active_B,
    lag,
    lag_n,
    *,
    cfg,
    needs_filter,
    greedy,
    bucket,
    with_prev=True,
):
    """An AR round over the engine's slots (:func:`runtime.ar_slot_round`) that records the tokens the
    idle draft misses. Returns what an SD round of K = 0 returns (host array (B, 2 + P): the token, 0
    accepted, the log-probability columns; tcache; the rows' (cur, prev, step); the catch-up flag,
    unchanged) and the new ``lag`` / ``lag_n``."""
    out, cur, tcache, steps = runtime.ar_slot_round(
        tparams, tcache, rows, active_B, cfg=cfg, needs_filter=needs_filter, greedy=greedy, bucket=bucket
    )
    first = (lag_n == 0) & with_prev  # SD's first lagging round records prev too; SSD's never
    col = jnp.arange(lag.shape[1])[None, :]
    on = active_B[:, None]
    lag = jnp.where(on & first[:, None] & (col == 0), rows.prev[:, None], lag)
    lag = jnp.where(on & (col == jnp.where(first, 1, lag_n)[:, None]), rows.cur[:, None], lag)
    lag_n = jnp.where(active_B, jnp.where(first, 2, lag_n + 1), lag_n)
    prev = jnp.where(active_B, rows.cur, rows.prev)
    out = jnp.concatenate([out[:, :1], jnp.zeros_like(out[:, :1]), out[:, 1:]], axis=1)
    return out, tcache, (cur, prev, steps), catch_up, lag, lag_n


@program_factory
def sd_lag_round_program(cfg, needs_filter: bool, greedy: bool, window, bucket, with_prev=True) -> Compiled:
    from ssd_jax.decoding.slots import windowed

    fn = functools.partial(
        sd_lag_round, cfg=cfg, needs_filter=needs_filter, greedy=greedy, bucket=bucket, with_prev=with_prev
    )
    return Compiled(windowed(fn, window, cache_args=(1,)), donate_argnums=(1, 5, 6), name="sd_lag_round")


def draft_flush(dparams, dcache, lag, lag_n, *, dcfg, width, bucket, back=1):
    """The draft's cache level with the target's again: each row's ``lag_n`` recorded tokens written from
    slot ``length - back`` on (SD: 1, SSD: 0; rows with none keep their cache; their forward writes land
    past their length, where nothing is read). Returns (dcache, zero counts)."""
    from ssd_jax.decoding.slots import take_rows

    part = llama.bucket_view(dcache, bucket)
    n = take_rows(lag_n, bucket)
    start = jnp.where(n > 0, part.lengths - back, part.lengths)
    part = draft_prefill(dparams, part.with_lengths(start), take_rows(lag, bucket)[:, :width], n, cfg=dcfg)
    return llama.bucket_merge(dcache, part, bucket), jnp.zeros_like(lag_n)


@program_factory
def draft_flush_program(dcfg, width: int, window, bucket) -> Compiled:
    from ssd_jax.decoding.slots import windowed

    fn = functools.partial(draft_flush, dcfg=dcfg, width=width, bucket=bucket)
    return Compiled(windowed(fn, window, cache_args=(1,)), donate_argnums=(1, 3), name="draft_flush")


def reset_lag(lag_n, admitted_B):
    """Admitted rows start with nothing to catch up (their prompts were prefilled into the draft)."""
    return jnp.where(admitted_B, 0, lag_n)
