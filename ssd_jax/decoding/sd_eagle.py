"""SD with an EAGLE-style head (:mod:`ssd_jax.drafters.eagle`): its prefill and its round, each one
compiled call over the engine's slots.

State between rounds, per row, besides the target's cache and rows: the head's cache (its pairs
up to the target's committed length minus one) and the **pending pairs**: the target's features at
the positions the last verify kept and the tokens after them (``tok`` (B, K+1), ``feat``
(B, K+1, n·D), ``n`` (B,)). A round:

1. draft  - the head takes the pending pairs (its cache reaches the target's length) and drafts K
            tokens, feeding its own outputs back (:func:`~ssd_jax.drafters.eagle.head_draft`);
2. verify - the target scores ``[cur, s_1..s_K]`` in one forward and returns the features of those
            K + 1 positions too (``llama.forward(capture=...)``);
3. sample - exact rejection sampling (``accept_step``); the kept positions' features and the emitted
            tokens (the accepted proposals and the bonus) become the next pending pairs.

Admission: the target's chunked prefill captures the prompt's features; the head prefills the pairs
(feature at ``j``, prompt token ``j + 1``) of each chunk, all but the prompt's last position, whose
pair (its feature, the first sampled token) is pending.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ssd_jax.compile import Compiled, program_factory
from ssd_jax.decoding.sd import accept_step
from ssd_jax.drafters import eagle
from ssd_jax.models import llama
from ssd_jax.sampling.filters import filter_logprobs, fold_in, sample, split


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pending:
    tok: jax.Array  # (B, W) int32: the token after each kept position
    feat: jax.Array  # (B, W, F): the target's features at those positions
    n: jax.Array  # (B,) int32: pairs pending

    @classmethod
    def empty(cls, batch: int, width: int, feat: int, dtype) -> Pending:
        import numpy as np

        return cls(
            np.zeros((batch, width), np.int32),
            np.zeros((batch, width, feat), dtype),
            np.ones(batch, np.int32),
        )


def prefill_eagle(
    tparams, tcache, rows, head, hcache, pend, tokens_RxC, n_valid_R, slots_R, starts_R, new, next_RxC, n_head_R,
    *, cfg, layers, whole, greedy, needs_filter,
):  # fmt: skip
    """One prefill chunk: the target's (:func:`~ssd_jax.decoding.slots.prefill_target`, its features
    captured), then the head's pairs of the chunk (``next`` the token after each position, ``n_head``
    how many pairs: the chunk's valid positions, less the prompt's last one); rows whose prompt ends in
    this chunk get their pending pair. Returns (tokens, log-probability columns, tcache, rows, hcache,
    pend)."""
    from ssd_jax.decoding.slots import gather_rows, prefill_target, scatter_rows

    tok, lpc, tcache, rows, feats = prefill_target(
        tparams, tcache, rows, tokens_RxC, n_valid_R, slots_R, starts_R, new, cfg=cfg, whole=whole,
        greedy=greedy, needs_filter=needs_filter, capture=layers,
    )  # fmt: skip
    part = gather_rows(hcache, slots_R, starts_R, whole)
    _, _, part = eagle.head_forward(head, tparams, cfg, next_RxC, feats, part, own=False)
    hcache = scatter_rows(hcache, part.with_lengths(starts_R + n_head_R), slots_R, whole)
    last = jnp.take_along_axis(feats, jnp.maximum(n_valid_R - 1, 0)[:, None, None], axis=1)[:, 0]
    ends = (n_valid_R > 0) & (n_head_R < n_valid_R)  # the prompt's last position is in this chunk
    sel = jnp.where(ends, slots_R, pend.n.shape[0])  # out of range: dropped
    pend = Pending(
        pend.tok.at[sel, 0].set(tok, mode="drop"),
        pend.feat.at[sel, 0].set(last.astype(pend.feat.dtype), mode="drop"),
        pend.n.at[sel].set(1, mode="drop"),
    )
    return tok, lpc, tcache, rows, hcache, pend


@program_factory
def eagle_prefill_program(cfg, layers, whole: bool, window, greedy: bool, needs_filter: bool) -> Compiled:
    from ssd_jax.decoding.slots import windowed

    fn = functools.partial(
        prefill_eagle, cfg=cfg, layers=layers, whole=whole, greedy=greedy, needs_filter=needs_filter
    )
    return Compiled(windowed(fn, window, cache_args=(1,)), donate_argnums=(1, 4, 5), name="eagle_prefill")


def eagle_slot_round(
    tparams, tcache, head, hcache, pend, rows, active_B, *, cfg, layers, k, needs_filter, greedy, bucket
):
    """One SD round with the head over the engine's slots (``bucket``: the first rows only). Returns (host
    array (B, K+2+P): the round's tokens, n_accepted, log-probability columns; tcache, hcache, pend,
    the rows' new (cur, prev, step))."""
    from ssd_jax.decoding.slots import pad_rows, park, put_rows, take_rows

    r, p = take_rows((rows, pend), bucket)
    tc, hc = llama.bucket_view(tcache, bucket), llama.bucket_view(hcache, bucket)
    B = r.cur.shape[0]

    def draw(key, lg, d):
        if greedy:
            return jnp.argmax(lg, axis=-1).astype(jnp.int32), None
        return sample(key, lg, r.rs, needs_filter), filter_logprobs(lg, r.rs, needs_filter)

    keys = split(fold_in(fold_in(r.key_batch, 1), r.steps), k)
    toks, q, hc = eagle.head_draft(
        head, tparams, hc, p.tok, p.feat, p.n, keys, draw, cfg=cfg, vocab=cfg.vocab_size
    )
    h, tc, feats = llama.forward(
        tparams, cfg, jnp.concatenate([r.cur[:, None], toks], axis=1), tc, capture=layers
    )
    logits = llama.logits(tparams, cfg, h)
    emitted, n, new_len, _, prev, nxt, lpc = accept_step(
        fold_in(r.key_batch, 2), r.steps, logits, toks, jnp.full((B,), k, jnp.int32), q, r.rs, tc.lengths, r.cur,
        needs_filter=needs_filter, greedy=greedy,
    )  # fmt: skip
    new_p = Pending(emitted.astype(jnp.int32), feats.astype(p.feat.dtype), n + 1)
    tcache = park(llama.bucket_merge(tcache, tc.with_lengths(new_len), bucket), active_B)
    hcache = park(llama.bucket_merge(hcache, hc, bucket), active_B)
    pend = put_rows(pend, new_p, bucket)
    new = put_rows((rows.cur, rows.prev, rows.steps), (nxt, prev, r.steps + 1), bucket)
    out = jnp.concatenate([emitted, n[:, None], lpc], axis=1)
    return pad_rows(out, rows.cur.shape[0]), tcache, hcache, pend, new


@program_factory
def eagle_round_program(cfg, layers, k: int, needs_filter: bool, greedy: bool, window, bucket) -> Compiled:
    from ssd_jax.decoding.slots import windowed

    fn = functools.partial(
        eagle_slot_round, cfg=cfg, layers=layers, k=k, needs_filter=needs_filter, greedy=greedy, bucket=bucket
    )
    return Compiled(windowed(fn, window, cache_args=(1,)), donate_argnums=(1, 3, 4), name="eagle_round")
