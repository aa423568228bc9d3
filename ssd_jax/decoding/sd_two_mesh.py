"""SD with the target and the draft model on disjoint meshes (possibly in different processes
under ``jax.distributed``): each round is one draft call and one target call, with the proposals
(tokens and q) crossing to the target and the outcome (next ``cur``, ``prev``, catch-up flag, new
lengths, with the round's tokens for the host) crossing back; same keys as
:func:`ssd_jax.decoding.sd.sd_round`, so the same tokens as the one-device loop."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ssd_jax.compile import program_factory
from ssd_jax.decoding import runtime
from ssd_jax.decoding.sd import accept_step, target_score
from ssd_jax.drafters.model import draft_propose
from ssd_jax.sampling.filters import fold_in


def sd_draft_side(dparams, dcache, rows, lengths_B, catch_up, *, dcfg, k, vocab, needs_filter):
    """Two meshes, draft side: roll the draft cache to the committed lengths, then K proposals (the
    draft half of :func:`sd_round`, same keys). Returns (tokens, q, dcache, rows one step on)."""
    dcache = dcache.with_lengths(lengths_B)
    kd = fold_in(fold_in(rows.key_batch, 1), rows.steps)

    def variant(c):
        def run(args):
            return draft_propose(*args, cfg=dcfg, k=k, vocab=vocab, needs_filter=needs_filter, catch_up=c)

        return run

    tokens, q, dcache = jax.lax.cond(
        catch_up, variant(True), variant(False), (dparams, dcache, rows.prev, rows.cur, kd, rows.rs)
    )
    return tokens, q, dcache, dataclasses.replace(rows, steps=rows.steps + 1)


def sd_target_side(tparams, tcache, rows, tokens_BxK, q, active_B, *, cfg, needs_filter):
    """Two meshes, target side: verify and rejection-sample (the target half of :func:`sd_round`).

    Returns (host array (B, K+2+P): emitted, n_accepted, log-probability columns; tcache, rows one round on, the outcome the draft needs: (cur, prev,
    catch_up, lengths))."""
    from ssd_jax.decoding.slots import park

    B, K = tokens_BxK.shape
    n_draft = jnp.full((B,), K, jnp.int32)
    logits, tcache = target_score(tparams, tcache, rows.cur, tokens_BxK, cfg=cfg)
    emitted, n, new_len, _, prev, cur, lpc = accept_step(
        fold_in(rows.key_batch, 2), rows.steps, logits, tokens_BxK, n_draft, q, rows.rs, tcache.lengths, rows.cur,
        needs_filter=needs_filter,
    )  # fmt: skip
    out = jnp.concatenate([emitted, n[:, None], lpc], axis=1)
    tcache = park(tcache.with_lengths(new_len), active_B)
    rows = dataclasses.replace(rows, cur=cur, prev=prev, steps=rows.steps + 1)
    return out, tcache, rows, (cur, prev, jnp.any((n >= n_draft) & active_B), tcache.lengths + 0)


def set_draft_rows(rows, lengths_B, slots_R, new, lengths_R):
    """Admission on the draft mesh: the new rows' state and committed lengths."""
    from ssd_jax.decoding.slots import set_rows

    return set_rows(rows, slots_R, new), lengths_B.at[slots_R].set(lengths_R)


@program_factory
def sd_two_mesh_programs(cfg, dcfg, k, vocab, needs_filter, window=None):
    from ssd_jax.decoding.slots import windowed

    draft = runtime.Compiled(
        functools.partial(sd_draft_side, dcfg=dcfg, k=k, vocab=vocab, needs_filter=needs_filter),
        donate_argnums=(1,),
        name="sd_draft",
    )
    fn = functools.partial(sd_target_side, cfg=cfg, needs_filter=needs_filter)
    target = runtime.Compiled(windowed(fn, window, cache_args=(1,)), donate_argnums=(1,), name="sd_verify")
    return draft, target, runtime.Compiled(set_draft_rows, name="sd_draft_admit")
