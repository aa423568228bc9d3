"""Speculative decoding (SD): the compiled round, ragged over the batch (the engine drives it:
:mod:`ssd_jax.engine.methods.sd`).

State between rounds, per row: the committed context (prompt + emitted tokens, all in the
target cache) and ``cur``, the last emitted token, which no cache holds yet. One round:

1. draft   - the drafter proposes up to K tokens after ``cur`` (``drafters.py``);
2. verify  - the target scores ``[cur, s_1..s_K]`` in ONE forward pass at each row's own
             offset, giving K+1 next-token distributions;
3. sample  - exact rejection sampling (``verify.py``) decides n_accepted per row and draws the
             bonus / correction token, which becomes the next ``cur``.

Rows accept different numbers of tokens; both caches advance per row by resetting their
lengths (rejected slots are simply overwritten later). Each stage is one compiled call; the
host blocks after each only to time it (the draft / verify / sample / overhead breakdown of
the vLLM study), which costs microseconds next to a forward pass.

``mean_acceptance_length`` is tokens emitted per verify step INCLUDING the bonus token;
``acceptance_rate`` is accepted / drafted proposals.

With ``target_devices`` / ``draft_devices`` and a draft model, target and draft live on disjoint
meshes (possibly in different processes under ``jax.distributed``): each round is one draft call
and one target call, with the proposals (tokens and q) crossing to the target and the outcome
(next ``cur``, ``prev``, catch-up flag, new lengths, with the round's tokens for the host) crossing
back (:mod:`ssd_jax.decoding.sd_two_mesh`); same keys as :func:`sd_round`, so the same tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.compile import program_factory
from ssd_jax.decoding import runtime
from ssd_jax.drafters.model import draft_propose
from ssd_jax.drafters.random import random_tokens
from ssd_jax.models import llama
from ssd_jax.sampling.filters import fold_in
from ssd_jax.sampling.logprobs import apply_min_tokens, columns_if_wanted
from ssd_jax.sampling.rejection import emitted_tokens, verify, verify_greedy


def host_width(n_draft_h: np.ndarray, live: np.ndarray, k: int) -> int:
    """How many proposal columns a host-drafted round verifies: ``k``, or 0 when no live row has a
    proposal (an n-gram miss everywhere), so that round costs one target step, not a (k+1)-token verify.
    Both SD loops use it, so seeded runs draw the same tokens on either."""
    return k if bool((n_draft_h[live] > 0).any()) else 0


def target_score(params, cache, cur_B, draft_BxK, *, cfg):
    """Target logits at the K+1 positions ``[cur, s_1..s_K]`` (cache lengths unchanged)."""
    toks = jnp.concatenate([cur_B[:, None], draft_BxK], axis=1)
    h, cache = llama.forward(params, cfg, toks, cache)
    return llama.logits(params, cfg, h), cache


def accept_step(
    key, step, logits, draft_BxK, n_draft_B, q, rs, lengths_B, cur_B, *, needs_filter, greedy=False
):
    """Rejection sampling + the per-row state update; returns what the host and next round need:
    (emitted (B, K+1), n_accepted, new lengths twice, prev, next cur, the emitted tokens' log-probability
    columns (:func:`~ssd_jax.sampling.logprobs.columns_if_wanted`)). The target's logits get the
    ``min_tokens`` ban first (column j predicts position ``length + 1 + j``).
    ``greedy`` (static): every row is greedy, so only the argmax matching runs (the same outcome)."""
    raw = logits
    logits = apply_min_tokens(logits, lengths_B[:, None] + 1 + jnp.arange(logits.shape[1]), rs)
    if greedy:
        res = verify_greedy(logits, draft_BxK, n_draft_B)
    else:
        res = verify(fold_in(key, step), logits, draft_BxK, n_draft_B, rs, needs_filter, q)
    n = res.n_accepted
    if draft_BxK.shape[1] == 0:  # a round with nothing proposed: one plain target step
        prev = cur_B
    else:
        prev = jnp.where(
            n > 0, jnp.take_along_axis(draft_BxK, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0], cur_B
        )
    new_len = lengths_B + 1 + n
    emitted = emitted_tokens(draft_BxK, res)
    lpc = columns_if_wanted(raw, emitted, rs)
    # two output buffers: the target's and the draft's caches are donated separately
    return emitted, n, new_len, new_len + 0, prev, res.next_token, lpc


def draft_stage(
    dparams, dcache, prev_B, cur_B, catch_up, kd, rs, host_tokens_BxK, host_n_B,
    *, dcfg, k, vocab, rand_vocab, needs_filter, kind, greedy=False,
):  # fmt: skip
    """The draft stage of :func:`sd_round` (``kd``: the round's draft key): (tokens (B, K), n_draft (B,),
    q (the draft's distributions; None unless ``kind="model"`` and sampling), dcache)."""
    B = cur_B.shape[0]
    q = None
    n_draft = jnp.full((B,), k, jnp.int32)
    if kind == "model":

        def variant(c):
            def run(args):
                return draft_propose(
                    *args, cfg=dcfg, k=k, vocab=vocab, needs_filter=needs_filter, catch_up=c, greedy=greedy
                )

            return run

        args = (dparams, dcache, prev_B, cur_B, kd, rs)
        if dcache.is_view:
            # a paged pool or a batch bucket's view: XLA:CPU copies a conditional's operand buffers, here
            # the whole pool (an 8-slot SmolLM2 draft's: 18 copies of 12.6 MB a round); the catch-up step
            # (rewriting the last slot with the token already there) costs one more draft token instead
            tokens, q, dcache = variant(True)(args)
        else:
            tokens, q, dcache = jax.lax.cond(catch_up, variant(True), variant(False), args)
    elif kind == "random":
        tokens = random_tokens(kd, B, k, rand_vocab)
    else:
        tokens, n_draft = host_tokens_BxK, host_n_B
    return tokens, n_draft, q, dcache


def sd_round(
    tparams,
    tcache,
    dparams,
    dcache,
    cur_B,
    prev_B,
    catch_up,
    step,
    key,
    rs,
    host_tokens_BxK,
    host_n_B,
    *,
    cfg,
    dcfg,
    k,
    vocab,
    rand_vocab,
    needs_filter,
    kind,
    greedy=False,
):
    """One whole SD round in one compiled call: draft K tokens, verify, rejection-sample, advance.

    ``kind``: "model" (the draft model; its catch-up variant chosen on device by ``lax.cond``),
    "random" (uniform proposals) or "host" (proposals computed on the host, e.g. n-gram lookup,
    passed in ``host_tokens_BxK`` / ``host_n_B``). ``step`` (a device scalar) and ``catch_up``
    come from the previous round's outputs, so rounds can be queued without the host.
    ``greedy`` (static): every row is at temperature 0, so the draft takes its argmax (no q) and the
    verify only matches argmaxes: the same tokens without the sampling work over the vocabulary.
    Randomness is that of the profiled path (same seed, same tokens). ``key`` and ``step`` may also be
    a (B,) batch of row keys and per-row steps (the server: each request draws from its own stream;
    not with ``kind="random"``).

    Returns (host array (B, K+2+P): the round's tokens, n_accepted, then the P log-probability columns;
    n_draft, tcache, dcache, cur, prev, catch_up, step + 1).
    """
    kdraft, kverify = fold_in(key, 1), fold_in(key, 2)
    tokens, n_draft, q, dcache = draft_stage(
        dparams, dcache, prev_B, cur_B, catch_up, fold_in(kdraft, step), rs, host_tokens_BxK, host_n_B,
        dcfg=dcfg, k=k, vocab=vocab, rand_vocab=rand_vocab, needs_filter=needs_filter, kind=kind,
        greedy=greedy,
    )  # fmt: skip
    logits, tcache = target_score(tparams, tcache, cur_B, tokens, cfg=cfg)
    emitted, n, new_len, _, prev, cur, lpc = accept_step(
        kverify,
        step,
        logits,
        tokens,
        n_draft,
        q,
        rs,
        tcache.lengths,
        cur_B,
        needs_filter=needs_filter,
        greedy=greedy,
    )
    tcache = tcache.with_lengths(new_len)
    if dcache is not None:
        dcache = dcache.with_lengths(new_len + 0)  # its own buffer: both caches are donated
    out = jnp.concatenate([emitted, n[:, None], lpc], axis=1)
    return out, n_draft, tcache, dcache, cur, prev, jnp.any(n >= n_draft), step + 1


def sd_slot_round(
    tparams,
    tcache,
    dparams,
    dcache,
    rows,
    catch_up,
    active_B,
    host_tokens_BxK,
    host_n_B,
    *,
    bucket=None,
    **kw,
):
    """:func:`sd_round` over the engine's slots: each row from its own key at its own step, free slots
    parked; ``bucket`` (static): only the first ``bucket`` slots run (every running row is among them).
    Returns (host array (B, K+2+P), tcache, dcache, the rows' new (cur, prev, step), catch-up flag)."""
    from ssd_jax.decoding.slots import pad_rows, park, put_rows, take_rows

    r, toks, n_h = take_rows((rows, host_tokens_BxK, host_n_B), bucket)
    out, n_draft, tc, dc, cur, prev, _, _ = sd_round(
        tparams, llama.bucket_view(tcache, bucket), dparams, llama.bucket_view(dcache, bucket), r.cur, r.prev,
        catch_up, r.steps, r.key_batch, r.rs, toks, n_h, **kw,
    )  # fmt: skip
    n_acc = out[:, toks.shape[1] + 1]  # after the K + 1 emitted columns
    catch = jnp.any((n_acc >= n_draft) & take_rows(active_B, bucket))  # a live row accepted all: catch up
    tcache, dcache = llama.bucket_merge(tcache, tc, bucket), llama.bucket_merge(dcache, dc, bucket)
    new = put_rows((rows.cur, rows.prev, rows.steps), (cur, prev, r.steps + 1), bucket)
    # only the rows' fields that change come back (each output is a buffer the host wraps every round)
    return pad_rows(out, rows.cur.shape[0]), park(tcache, active_B), park(dcache, active_B), new, catch


@program_factory
def sd_round_program(
    cfg, dcfg, k, vocab, rand_vocab, needs_filter, kind, greedy=False, window=None, bucket=None
):
    from ssd_jax.decoding.slots import windowed

    fn = functools.partial(
        sd_slot_round, cfg=cfg, dcfg=dcfg, k=k, vocab=vocab, rand_vocab=rand_vocab,
        needs_filter=needs_filter, kind=kind, greedy=greedy, bucket=bucket,
    )  # fmt: skip
    return runtime.Compiled(windowed(fn, window), donate_argnums=(1, 3), name="sd_round")


@program_factory
def sd_steps(cfg, needs_filter: bool):
    score = runtime.Compiled(functools.partial(target_score, cfg=cfg), donate_argnums=(1,), name="verify")
    acc = runtime.Compiled(functools.partial(accept_step, needs_filter=needs_filter), name="sample")
    return score, acc
