"""The SSD device functions: the speculation tree (cache build: re-run, top-F candidates excluding
the next proposal, all branches decoded K steps under a tree mask), the on-device lookup with
the fallback in the same program (host proposals merged there too) and the first round's
speculation. :mod:`.rounds` compiles them into the round's programs.
See :mod:`ssd_jax.decoding.ssd` for the algorithm.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ssd_jax.drafters.base import Proposal, align_vocab
from ssd_jax.drafters.model import draft_loop
from ssd_jax.drafters.random import random_tokens
from ssd_jax.models import llama
from ssd_jax.sampling.rejection import mark_point_mass
from ssd_jax.sampling.filters import split
from ssd_jax.sampling.saguaro import draft_sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    """The speculation cache of one round: B branches per row keyed by (k, t)."""

    k: jax.Array  # (B, M) int32 accepted-length key, -1 for unused slots
    t: jax.Array  # (B, M) int32 bonus-token key
    tokens: jax.Array  # (B, M, K) int32
    q: jax.Array | None  # (B, M, K, V) float32, None when greedy


@dataclasses.dataclass(frozen=True)
class Opts:
    """Static options of the SSD programs (hashable: part of the compile cache key)."""

    k: int
    budget: int
    vocab: int  # the target's vocabulary size (draft logits are aligned to it)
    rand_vocab: int  # ids the random backup draws from
    needs_filter: bool
    greedy: bool
    c: float
    tree_base: int  # first slot of the tree region in the draft cache
    mesh: jax.sharding.Mesh | None = (
        None  # the draft mesh; with > 1 device the branch axis is sharded over it
    )


def branch_sharding(mesh, ndim: int) -> NamedSharding:
    """(B, M, ...) arrays: the branch axis M split over the draft mesh."""
    return NamedSharding(mesh, PartitionSpec(None, "tp", *([None] * (ndim - 2))))


def _constrain(x, opts: Opts):
    if opts.mesh is None or x is None:
        return x
    return jax.lax.with_sharding_constraint(x, branch_sharding(opts.mesh, x.ndim))


def _replicate(tree, opts: Opts):
    if opts.mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(opts.mesh, PartitionSpec()))


def draft_chain(params, cache, cur_B, key, rs, fan_BxK, *, cfg, opts: Opts):
    """K draft tokens after ``cur`` (cache lengths = committed length; cur not in the cache), by the
    drafters' K-step loop with Saguaro sampling. Returns (tokens (B, K), q (B, K, V) | None, cache
    with the same lengths)."""

    def draw(key_d, lg, d):
        return draft_sample(
            key_d,
            lg,
            rs,
            fan_BxK[:, d],
            needs_filter=opts.needs_filter,
            greedy=opts.greedy,
            c=opts.c,
            f_max=opts.budget,
        )

    start = cache.lengths
    toks, q, cache = draft_loop(
        params, cache, cur_B, cur_B, split(key, opts.k), draw, cfg=cfg, vocab=opts.vocab, catch_up=False
    )
    return toks, q, cache.with_lengths(start)


def candidates(lg_BxK1xV, spec_tokens, spec_n, kb_BxM, rb_BxM, M: int):
    """The branches' keys from the draft's K + 1 distributions after ``[cur, s_1..s_K]``: the top-M
    tokens at each position, excluding ``s_{k+1}`` where it was a real proposal (a rejected proposal
    cannot be the bonus there), picked by the layout (``kb``: accepted length, ``rb``: rank; -1 unused).
    Returns (valid (B, M), k (B, M), t (B, M))."""
    B, K1 = lg_BxK1xV.shape[:2]
    K = K1 - 1
    nxt = jnp.concatenate([spec_tokens, jnp.zeros((B, 1), spec_tokens.dtype)], axis=1)
    excl = jnp.arange(K + 1)[None, :] < spec_n[:, None]
    cur_val = jnp.take_along_axis(lg_BxK1xV, nxt[..., None], axis=-1)
    lg = jnp.put_along_axis(
        lg_BxK1xV, nxt[..., None], jnp.where(excl[..., None], -jnp.inf, cur_val), axis=-1, inplace=False
    )
    _, cand = jax.lax.top_k(lg, M)  # (B, K+1, M)
    kb = jnp.clip(kb_BxM, 0, K)
    flat = kb * M + jnp.clip(rb_BxM, 0, M - 1)
    t0 = jnp.take_along_axis(cand.reshape(B, (K + 1) * M), flat, axis=1).astype(jnp.int32)
    return kb_BxM >= 0, kb, t0


def lookup(tree: Tree, n_acc_B, bonus_B):
    """The verification outcome (k, t*) looked up in the tree: (hit (B,), the branch's tokens (B, K),
    its q (B, K, V) or None); rows that missed get branch 0's, to be replaced."""
    match = (tree.k == n_acc_B[:, None]) & (tree.t == bonus_B[:, None])
    idx = jnp.argmax(match, axis=1)
    tokens = jnp.take_along_axis(tree.tokens, idx[:, None, None], axis=1)[:, 0]
    q = None if tree.q is None else jnp.take_along_axis(tree.q, idx[:, None, None, None], axis=1)[:, 0]
    return match.any(axis=1), tokens, q


def build_tree(
    params, cache, cur_B, spec_tokens, spec_n, kb_BxM, rb_BxM, fan_BxK, key, rs, *, cfg, opts: Opts
):
    """Predict the outcomes of the speculation being verified and pre-draft each (see module doc)."""
    K, M = opts.k, opts.budget
    B = cur_B.shape[0]
    start = cache.lengths
    # 1. re-run [cur, s_1..s_K]: K+1 next-token distributions, and those slots written
    h, cache = llama.forward(params, cfg, jnp.concatenate([cur_B[:, None], spec_tokens], axis=1), cache)
    lg = align_vocab(llama.logits(params, cfg, h), opts.vocab)  # (B, K+1, V)
    # 2. candidates: top-M per position, excluding s_{k+1} where it was a real proposal
    valid, kb, t0 = candidates(lg, spec_tokens, spec_n, kb_BxM, rb_BxM, M)
    t0 = _constrain(t0, opts)
    # 3. decode every branch K steps under the tree mask
    S = cache.max_len
    slot = jnp.arange(S)
    prefix = slot[None, None, :] <= (start[:, None] + kb)[:, :, None]  # context + cur + s_1..s_k
    base = opts.tree_base + jnp.arange(M) * K  # (M,) first tree slot of each branch
    pos0 = start[:, None] + kb + 1

    def body(carry, xs):
        cache, tok = carry
        d, key_d = xs
        own = (slot[None, :] >= base[:, None]) & (slot[None, :] <= base[:, None] + d)  # (M, S)
        h, cache = llama.forward(
            params,
            cfg,
            tok,
            cache,
            positions_BxT=pos0 + d,
            slots_BxT=jnp.broadcast_to(base + d, (B, M)),
            mask_BxTxS=prefix | own[None],
        )
        lg = align_vocab(llama.logits(params, cfg, h), opts.vocab)  # (B, M, V)
        fan = jnp.broadcast_to(fan_BxK[:, d][:, None], (B, M))
        nxt, lp = draft_sample(
            key_d,
            lg,
            rs,
            fan,
            needs_filter=opts.needs_filter,
            greedy=opts.greedy,
            c=opts.c,
            f_max=opts.budget,
        )
        return (cache, _constrain(nxt, opts)), (nxt, lp)

    (cache, _), (toks, qs) = jax.lax.scan(body, (cache, t0), (jnp.arange(K), split(key, K)))
    tree = Tree(
        k=_constrain(jnp.where(valid, kb, -1), opts),
        t=t0,
        tokens=_constrain(jnp.moveaxis(toks, 0, 2), opts),
        q=None if qs is None else _constrain(jnp.moveaxis(qs, 0, 2), opts),
    )
    return tree, _replicate(cache.with_lengths(start), opts)


def advance(
    params,
    tree: Tree,
    cache,
    n_acc_B,
    bonus_B,
    new_len_B,
    live_B,
    key,
    rs,
    fan_BxK,
    *,
    cfg,
    opts: Opts,
    backup: str,
    host_tokens=None,
    host_n=None,
):
    """Cache lookup for the verification outcome, plus the fallback for rows that missed.

    ``backup``: "neural" (re-draft just in time, skipped by ``lax.cond`` when every live row
    hit), "random" (point-mass random tokens) or "host" (``host_tokens`` / ``host_n``: proposals
    the host computed for every row, e.g. n-gram lookups, used where the row missed).
    Returns (next speculation (a Proposal with its hit flags), draft cache at the new committed lengths).
    """
    B, K = bonus_B.shape[0], opts.k
    hit, tokens, q = lookup(tree, n_acc_B, bonus_B)
    cache = cache.with_lengths(new_len_B)
    n_draft = jnp.full((B,), K, jnp.int32)
    if backup == "neural":

        def redraft(cache):
            return draft_chain(params, cache, bonus_B, key, rs, fan_BxK, cfg=cfg, opts=opts)

        def keep(cache):
            return tokens, q, cache

        if cache.is_view:
            # XLA:CPU would copy the draft's whole cache for the conditional; re-drafting every round costs
            # K draft steps of the bucket's rows instead
            f_tok, f_q, cache = redraft(cache)
        else:
            f_tok, f_q, cache = jax.lax.cond(jnp.any(live_B & ~hit), redraft, keep, cache)
        tokens = jnp.where(hit[:, None], tokens, f_tok)
        if q is not None:
            q = jnp.where(hit[:, None, None], q, f_q)
    elif backup == "random":
        rnd = random_tokens(key, B, K, opts.rand_vocab)
        tokens = jnp.where(hit[:, None], tokens, rnd)
        if q is not None:
            q = mark_point_mass(q, jnp.broadcast_to(~hit[:, None], (B, K)))
    elif backup == "host" and host_tokens is not None:  # without them: the lookup alone
        tokens = jnp.where(hit[:, None], tokens, host_tokens)
        n_draft = jnp.where(hit, n_draft, host_n)
        if q is not None:
            q = mark_point_mass(q, jnp.broadcast_to(~hit[:, None], (B, K)))
    return _replicate((Proposal(tokens, n_draft, q, hit), cache), opts)


def first_spec(params, cache, cur_B, key, rs, fan_BxK, *, cfg, opts: Opts, backup: str):
    """The first round's speculation (no cache yet): neural drafting or random point masses."""
    B, K = cur_B.shape[0], opts.k
    miss = jnp.zeros((B,), bool)
    if backup == "neural":
        tokens, q, cache = draft_chain(params, cache, cur_B, key, rs, fan_BxK, cfg=cfg, opts=opts)
        return _replicate((Proposal(tokens, jnp.full((B,), K, jnp.int32), q, miss), cache), opts)
    tokens = random_tokens(key, B, K, opts.rand_vocab)
    q = None if opts.greedy else jnp.full((B, K, opts.vocab), -jnp.inf, jnp.float32)
    return _replicate((Proposal(tokens, jnp.full((B,), K, jnp.int32), q, miss), cache), opts)
