"""The server's device programs: admit one prompt chunk into a slot, and one round for every slot.

Thin wrappers around the offline engine's steps (``runtime.prefill_step``, ``runtime.decode_step``,
``drafters.model.draft_prefill``, ``sd.sd_round``, SSD's ``rounds.fused_round``) with row keys and
per-row steps; each is one :class:`~ssd_jax.compile.Compiled` with the caches donated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ssd_jax.compile import Compiled
from ssd_jax.decoding import runtime
from ssd_jax.decoding.sd import sd_round
from ssd_jax.decoding.ssd import tree as ssd_tree
from ssd_jax.decoding.ssd.rounds import fused_round
from ssd_jax.drafters.base import Proposal
from ssd_jax.drafters.model import draft_prefill
from ssd_jax.models.llama import KVCache
from ssd_jax.sampling.filters import fold_in


def _row(cache: KVCache, slot, start) -> KVCache:
    """Slot ``slot`` of ``cache`` as a batch of one, its length set to ``start``."""
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)
    return KVCache([take(x) for x in cache.k], [take(x) for x in cache.v], start[None], cache.window)


def _put_row(cache: KVCache, row: KVCache, slot) -> KVCache:
    put = lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, axis=0)
    return KVCache(
        [put(x, r) for x, r in zip(cache.k, row.k)],
        [put(x, r) for x, r in zip(cache.v, row.v)],
        cache.lengths.at[slot].set(row.lengths[0]),
    )


def context_windows(max_len: int, buckets: int) -> tuple[int, ...]:
    """The attention windows a server compiles (``KVCache.window``): ``max_len`` halved ``buckets - 1``
    times, each rounded up to a multiple of 16 and at least 32."""
    if buckets < 1:
        raise ValueError("buckets must be >= 1")
    return tuple(
        sorted({max_len} | {min(max_len, max(32, -(-(max_len >> i) // 16) * 16)) for i in range(buckets)})
    )


def windowed(fn, window: int, cache_args=(1, 3)):
    """``fn`` with the KV caches among ``cache_args`` attending over their first ``window`` slots only, and
    every cache it returns back to the full window (so the stored caches keep one pytree structure)."""

    def run(*args):
        args = [
            a.with_window(window) if i in cache_args and isinstance(a, KVCache) else a
            for i, a in enumerate(args)
        ]
        return tuple(o.with_window(None) if isinstance(o, KVCache) else o for o in fn(*args))

    return run


def admit_chunk(
    tparams, tcache, dparams, dcache, tokens_1xC, n_valid_1, slot, start, key_1, rs_1, *, cfg, dcfg
):
    """Prefill one chunk of a prompt into slot ``slot`` (rows of both caches), at offset ``start``.

    Returns (the token sampled after the chunk's last valid token, tcache, dcache); only the last
    chunk's token is used. Sampling always filters (top-k 0 / top-p 1 leave a row unchanged), so one
    program serves every request."""
    keys = jax.random.wrap_key_data(key_1)
    tok, row = runtime.prefill_step(
        tparams, _row(tcache, slot, start), tokens_1xC, n_valid_1, keys, rs_1, cfg=cfg, needs_filter=True
    )
    tcache = _put_row(tcache, row, slot)
    if dcache is not None:
        drow = draft_prefill(dparams, _row(dcache, slot, start), tokens_1xC, n_valid_1, cfg=dcfg)
        dcache = _put_row(dcache, drow, slot)
    return tok, tcache, dcache


def _park(cache: KVCache | None, active_B) -> KVCache | None:
    """Free slots keep length 0, so a slot never runs past the cache while it waits for a request."""
    return None if cache is None else cache.with_lengths(jnp.where(active_B, cache.lengths, 0))


def ar_round(params, cache, cur_B, key_Bx2, steps_B, active_B, rs, *, cfg, needs_filter):
    """One AR step for every slot, each row drawing from its own key at its own step."""
    keys = jax.random.wrap_key_data(key_Bx2)
    tok, cache = runtime.decode_step(
        params, cache, cur_B, keys, steps_B, rs, cfg=cfg, needs_filter=needs_filter
    )
    return tok, _park(cache, active_B)


def spec_round(
    tparams,
    tcache,
    dparams,
    dcache,
    cur_B,
    prev_B,
    catch_up,
    key_Bx2,
    steps_B,
    active_B,
    rs,
    host_tokens_BxK,
    host_n_B,
    *,
    cfg,
    dcfg,
    k,
    vocab,
    needs_filter,
    kind,
):
    """One SD round for every slot (:func:`ssd_jax.decoding.sd.sd_round` with row keys and steps).

    Returns (emitted (B, K+2): tokens then n_accepted, tcache, dcache, cur, prev)."""
    keys = jax.random.wrap_key_data(key_Bx2)
    out, _, tcache, dcache, cur, prev, _, _ = sd_round(
        tparams,
        tcache,
        dparams,
        dcache,
        cur_B,
        prev_B,
        catch_up,
        steps_B,
        keys,
        rs,
        host_tokens_BxK,
        host_n_B,
        cfg=cfg,
        dcfg=dcfg,
        k=k,
        vocab=vocab,
        rand_vocab=vocab,
        needs_filter=needs_filter,
        kind=kind,
    )
    return out, _park(tcache, active_B), _park(dcache, active_B), cur, prev


def ssd_first(dparams, dcache, sp: Proposal, cur_1, slot, key_1, rs_1, fan_K, *, dcfg, opts):
    """The first speculation of the sequence just admitted to ``slot`` (neural, K draft steps from its
    first token), written into the batch's speculation; with ``opts.greedy`` the batch carries no q."""
    keys = fold_in(jax.random.wrap_key_data(key_1), 1)  # the row's draft stream, as in ssd_round
    row = _row(dcache, slot, dcache.lengths[slot])
    tokens, q, row = ssd_tree.draft_chain(
        dparams, row, cur_1, fold_in(keys, 0), rs_1, fan_K[None], cfg=dcfg, opts=opts
    )
    put = lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, axis=0)
    sp = Proposal(
        put(sp.tokens, tokens),
        sp.n_draft.at[slot].set(opts.k),
        None if sp.q is None else put(sp.q, q),
        sp.hit.at[slot].set(False),
    )
    return sp, _put_row(dcache, row, slot)


def ssd_round(
    tparams,
    tcache,
    dparams,
    dcache,
    cur_B,
    sp: Proposal,
    key_Bx2,
    steps_B,
    active_B,
    rs,
    ctrl,
    *,
    cfg,
    dcfg,
    opts,
    ctl,
    needs_filter,
):
    """One SSD round for every slot (:func:`ssd_jax.decoding.ssd.rounds.fused_round`: verify, rejection
    sampling, cache build and lookup with the neural backup, in one call) with row keys and steps.

    Returns (host array (B, K+2+4): tokens, n_accepted, hit, post-miss, n_draft, live; the next
    speculation, tcache, dcache). The next ``cur`` of a row is its last emitted token, read from the
    host array."""
    keys = jax.random.wrap_key_data(key_Bx2)
    kverify, kdraft = fold_in(keys, 2), fold_in(keys, 1)
    B = cur_B.shape[0]
    out, sp, _, tcache, dcache, _, _ = fused_round(
        tparams,
        tcache,
        dparams,
        dcache,
        cur_B,
        sp,
        jnp.zeros((B,), bool),
        jnp.zeros((B,), jnp.int32),
        steps_B,
        kverify,
        kdraft,
        rs,
        ctrl,
        cfg=cfg,
        dcfg=dcfg,
        opts=opts,
        ctl=ctl,
        backup="neural",
        max_new=2**30,
        needs_filter=needs_filter,
    )
    return out, sp, _park(tcache, active_B), _park(dcache, active_B)


@functools.lru_cache(maxsize=8)
def ssd_programs(cfg, dcfg, opts, ctl, windows: tuple[int, ...]):
    """(first, {(greedy, needs_filter, window): round}) for SSD: greedy rounds carry no draft
    distributions; the window applies to the target cache only (the draft's tree region lies past
    the context)."""
    first, rounds = {}, {}
    for greedy in (True, False):
        o = dataclasses.replace(opts, greedy=greedy, needs_filter=not greedy)
        first[greedy] = Compiled(
            functools.partial(ssd_first, dcfg=dcfg, opts=o), donate_argnums=(1, 2), name="ssd_first"
        )
        for f in (False,) if greedy else (False, True):
            o = dataclasses.replace(opts, greedy=greedy, needs_filter=f)
            fn = functools.partial(ssd_round, cfg=cfg, dcfg=dcfg, opts=o, ctl=ctl, needs_filter=f)
            for w in windows:
                rounds[greedy, f, w] = Compiled(
                    windowed(fn, w, cache_args=(1,)), donate_argnums=(1, 3), name=f"ssd_round_w{w}"
                )
    return first, rounds


@functools.lru_cache(maxsize=8)
def programs(cfg, dcfg, method: str, k: int, kind: str, windows: tuple[int, ...]):
    """({window: admit}, {(needs_filter, window): round}) for a target config, draft config (or None),
    method, drafter kind and the attention windows."""
    admit = {
        w: Compiled(
            windowed(functools.partial(admit_chunk, cfg=cfg, dcfg=dcfg), w),
            donate_argnums=(1, 3),
            name=f"admit_w{w}",
        )
        for w in windows
    }
    if method == "ar":
        fns = {
            f: (functools.partial(ar_round, cfg=cfg, needs_filter=f), (1,), "ar_round") for f in (False, True)
        }
    else:
        fns = {
            f: (
                functools.partial(
                    spec_round, cfg=cfg, dcfg=dcfg, k=k, vocab=cfg.vocab_size, needs_filter=f, kind=kind
                ),
                (1, 3),
                "sd_round",
            )
            for f in (False, True)
        }
    rounds = {
        (f, w): Compiled(windowed(fn, w), donate_argnums=donate, name=f"{name}_w{w}")
        for f, (fn, donate, name) in fns.items()
        for w in windows
    }
    return admit, rounds
