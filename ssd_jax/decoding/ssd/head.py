"""SSD with an EAGLE-style head (:mod:`ssd_jax.drafters.eagle`): the speculation tree from the head's own
features, and the round as one compiled call on one device.

A head drafts from the target's features, and while the target verifies round T the features of round
T's tokens do not exist yet. The head has its own guess of them: its layer's output at a pair is what it
feeds back as the next position's features when it drafts. So the tree of round T is built from what the
head has while the verify runs:

1. the **pending pairs** (the target's features at the positions round T-1 kept, the tokens after them)
   go into the head's cache, which then reaches the committed length L; the last pair's output ``g_0``
   stands for the target's features at ``cur`` and its logits for the token after ``cur``;
2. the head **re-runs the speculation** being verified, ``s_1..s_K``, feeding its own outputs back: pair
   (``g_{k-1}``, ``s_k``) at position ``L + k - 1`` gives ``g_k`` and the distribution of the token after
   ``s_k``. These K + 1 distributions are where the outcomes' bonus tokens are predicted, as SSD's draft
   model does by re-running the speculation;
3. every **branch** (k, t) (k proposals accepted, bonus t; the top-F tokens at position k, excluding
   ``s_{k+1}``, which a rejection cannot emit there) drafts K tokens from the pair (``g_k``, t) at
   position L + k, seeing the committed pairs and the first k re-run pairs (a tree mask; its own pairs in
   a tree region of the head's cache), with Saguaro sampling.

The verify then gives the outcome (k, t*) and the target's true features of the kept positions (the
next pending pairs). A hit hands over the branch's K tokens and their distributions q; a miss re-drafts
just in time from the true pending pairs (the neural backup, what SD with the head does every round).
Every speculation carries the q it was drawn from, so the output is exact on hits and misses alike.

Only the head's pairs at committed positions persist between rounds: the re-run pairs past L are
overwritten by the true pending pairs next round, and the tree region by the next tree.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ssd_jax.compile import Compiled, program_factory
from ssd_jax.decoding.sd import accept_step
from ssd_jax.decoding.sd_eagle import Pending
from ssd_jax.decoding.ssd.rounds import Control, pack_meta
from ssd_jax.decoding.ssd.tree import Opts, Tree, candidates, lookup
from ssd_jax.drafters import eagle
from ssd_jax.drafters.base import Proposal, align_vocab
from ssd_jax.models import llama
from ssd_jax.sampling.filters import fold_in, split
from ssd_jax.sampling.saguaro import draft_sample


def _sampler(rs, fan_BxK, opts: Opts):
    def draw(key, lg, d):
        return draft_sample(
            key, lg, rs, fan_BxK[:, d], needs_filter=opts.needs_filter, greedy=opts.greedy, c=opts.c,
            f_max=opts.budget,
        )  # fmt: skip

    return draw


def head_chain(head, tparams, hcache, pend: Pending, key, rs, fan_BxK, *, cfg, opts: Opts):
    """K tokens drafted just in time from the true pending pairs (admission's first speculation and the
    neural backup), with Saguaro sampling. Returns (tokens, q | None, the cache at its old lengths: the
    pending pairs stay pending for the next tree)."""
    start = hcache.lengths
    toks, q, hcache = eagle.head_draft(
        head, tparams, hcache, pend.tok, pend.feat, pend.n, split(key, opts.k), _sampler(rs, fan_BxK, opts),
        cfg=cfg, vocab=opts.vocab,
    )  # fmt: skip
    return toks, q, hcache.with_lengths(start)


def head_tree(head, tparams, hcache, pend: Pending, spec_tokens, spec_n, kb_BxM, rb_BxM, fan_BxK, key, rs, *, cfg, opts: Opts):  # fmt: skip
    """The speculation tree of the round being verified, from the pending pairs and the head's own
    features (module doc). Returns (tree, the head's cache at the committed length L)."""
    K, M = opts.k, opts.budget
    B = spec_tokens.shape[0]
    # 1. the pending pairs: the cache reaches L
    h, g, hc = eagle.head_forward(head, tparams, cfg, pend.tok, pend.feat, hcache, own=False)
    last = (pend.n - 1)[:, None, None]
    hs = [jnp.take_along_axis(h, last, axis=1)[:, 0]]
    gs = [jnp.take_along_axis(g, last, axis=1)[:, 0]]
    L = hcache.lengths + pend.n
    # 2. the speculation re-run over the head's own features (K is small and static: unrolled)
    for d in range(K):
        h, g, hc = eagle.head_forward(
            head, tparams, cfg, spec_tokens[:, d : d + 1], gs[-1][:, None], hc.with_lengths(L + d), own=True
        )
        hs.append(h[:, 0])
        gs.append(g[:, 0])
    lg = align_vocab(eagle.head_logits(head, tparams, cfg, jnp.stack(hs, 1)), opts.vocab)  # (B, K+1, V)
    feats = jnp.stack(gs, 1)  # (B, K+1, D): the head's stand-ins for the target's features at L + k
    valid, kb, t0 = candidates(lg, spec_tokens, spec_n, kb_BxM, rb_BxM, M)
    # 3. every branch K steps under the tree mask
    S = hc.max_len
    slot = jnp.arange(S)
    prefix = slot[None, None, :] < (L[:, None] + kb)[:, :, None]  # committed pairs + re-run pairs 1..k
    base = opts.tree_base + jnp.arange(M) * K
    pos0 = L[:, None] + kb
    g0 = jnp.take_along_axis(feats, kb[:, :, None], axis=1)  # (B, M, D)

    def body(carry, xs):
        hc, tok, g = carry
        d, key_d = xs
        own = (slot[None, :] >= base[:, None]) & (slot[None, :] <= base[:, None] + d)  # (M, S)
        h, g, hc = eagle.head_forward(
            head, tparams, cfg, tok, g, hc, own=True, positions_BxT=pos0 + d,
            slots_BxT=jnp.broadcast_to(base + d, (B, M)), mask_BxTxS=prefix | own[None],
        )  # fmt: skip
        lg = align_vocab(eagle.head_logits(head, tparams, cfg, h), opts.vocab)  # (B, M, V)
        fan = jnp.broadcast_to(fan_BxK[:, d][:, None], (B, M))
        nxt, lp = draft_sample(
            key_d, lg, rs, fan, needs_filter=opts.needs_filter, greedy=opts.greedy, c=opts.c, f_max=M
        )
        return (hc, nxt, g), (nxt, lp)

    (hc, _, _), (toks, qs) = jax.lax.scan(body, (hc, t0, g0), (jnp.arange(K), split(key, K)))
    tree = Tree(
        k=jnp.where(valid, kb, -1), t=t0, tokens=jnp.moveaxis(toks, 0, 2),
        q=None if qs is None else jnp.moveaxis(qs, 0, 2),
    )  # fmt: skip
    return tree, hc.with_lengths(L)


def ssd_head_round(
    tparams, tcache, head, hcache, pend, rows, sp: Proposal, active_B, ctrl, *, cfg, layers, opts: Opts,
    ctl: Control, needs_filter: bool, greedy: bool,
):  # fmt: skip
    """One SSD round with a head over the engine's slots, one call: the verify (features captured) and
    rejection sampling, the tree from the head's own features, the lookup and the neural backup.
    Returns (host array (B, K+2+4+P): emitted, n_accepted, the next speculation's meta (hit, 0, n_draft,
    live), the log-probability columns; the next speculation, tcache, hcache, pend, the rows' (cur,
    prev, step))."""
    from ssd_jax.decoding.slots import park

    K = opts.k
    B = rows.cur.shape[0]
    kb_tab, rb_tab, fan, host_live = ctl.unpack(ctrl)
    kdraft = fold_in(fold_in(rows.key_batch, 1), rows.steps)
    # verify: the target over [cur, s_1..s_K], its features at the head's layers kept
    h, tc, feats = llama.forward(
        tparams, cfg, jnp.concatenate([rows.cur[:, None], sp.tokens], axis=1), tcache, capture=layers
    )
    emitted, n, new_len, _, prev, nxt, lpc = accept_step(
        fold_in(rows.key_batch, 2), rows.steps, llama.logits(tparams, cfg, h), sp.tokens, sp.n_draft, sp.q,
        rows.rs, tc.lengths, rows.cur, needs_filter=needs_filter, greedy=greedy,
    )  # fmt: skip
    # the tree (in SSD proper it runs beside the verify: it reads nothing the verify computes)
    zeros = jnp.zeros(B, jnp.int32)
    tree, hc = head_tree(
        head, tparams, hcache, pend, sp.tokens, sp.n_draft, kb_tab[zeros], rb_tab[zeros], fan,
        fold_in(kdraft, 0), rows.rs, cfg=cfg, opts=opts,
    )  # fmt: skip
    new_pend = Pending(emitted.astype(jnp.int32), feats.astype(pend.feat.dtype), n + 1)
    live = host_live & (new_len + 1 < rows.limit)
    hit, tokens, q = lookup(tree, n, nxt)

    def redraft(hc):
        return head_chain(head, tparams, hc, new_pend, fold_in(kdraft, 1), rows.rs, fan, cfg=cfg, opts=opts)

    def keep(hc):
        return tokens, q, hc

    f_tok, f_q, hc = jax.lax.cond(jnp.any(live & ~hit), redraft, keep, hc)
    tokens = jnp.where(hit[:, None], tokens, f_tok)
    if q is not None:
        q = jnp.where(hit[:, None, None], q, f_q)
    elif sp.q is not None:  # a greedy round: the speculations keep their q arrays
        q = sp.q
    n_draft = jnp.full((B,), K, jnp.int32)
    new_sp = Proposal(tokens, n_draft, q, hit)
    meta = pack_meta(hit=hit, post_miss=jnp.zeros_like(hit), n_draft=n_draft, live=live)
    out = jnp.concatenate([emitted, n[:, None], meta, lpc], axis=1)
    tcache = park(tc.with_lengths(new_len), active_B)
    hcache = park(hc, active_B)
    return out, new_sp, tcache, hcache, new_pend, (nxt, prev, rows.steps + 1)


def first_head_spec(
    head, tparams, hcache, pend, rows, sp: Proposal, slots_R, ctrl, *, cfg, opts: Opts, ctl: Control
):
    """Admission: the first speculation of the rows in ``slots_R`` (drafted from their pending pair, as SD
    with the head drafts), written into the batch's. Returns (sp, hcache)."""
    _, _, fan, _ = ctl.unpack(ctrl)
    key = fold_in(fold_in(rows.key_batch, 3), 0)  # a stream of its own (rounds: 1 and 2)
    toks, q, hc = head_chain(head, tparams, hcache, pend, key, rows.rs, fan, cfg=cfg, opts=opts)
    sel = jnp.zeros(rows.cur.shape[0], bool).at[slots_R].set(True)
    tokens = jnp.where(sel[:, None], toks, sp.tokens)
    if sp.q is not None and q is not None:
        q = jnp.where(sel[:, None, None], q, sp.q)
    else:
        q = sp.q
    n_draft = jnp.where(sel, opts.k, sp.n_draft)
    return Proposal(tokens, n_draft, q, sp.hit & ~sel), hc


@program_factory
def ssd_head_programs(cfg, layers, opts: Opts, ctl: Control, needs_filter: bool, greedy: bool, window):
    """The round (per mode and window) and admission's first speculation, compiled."""
    from ssd_jax.decoding.slots import windowed

    rnd = functools.partial(
        ssd_head_round, cfg=cfg, layers=layers, opts=opts, ctl=ctl, needs_filter=needs_filter, greedy=greedy
    )
    first = functools.partial(first_head_spec, cfg=cfg, opts=opts, ctl=ctl)
    return {
        "round": Compiled(
            windowed(rnd, window, cache_args=(1,)), donate_argnums=(1, 3, 4), name="ssd_head_round"
        ),
        "first": Compiled(first, donate_argnums=(2,), name="ssd_head_first"),
    }
