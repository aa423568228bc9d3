"""Device functions over slots: the per-row state every method keeps on the device between rounds,
prefilling prompt chunks into some rows of a batch's caches, and the attention windows.

The engine (:mod:`ssd_jax.engine`) runs a fixed batch of slots. A sequence is admitted into a free
slot by prefilling its prompt, chunk by chunk, into that slot's rows of the caches; its per-row
values (the last token, the step counter, its own random key, its sampling parameters, its token
limit) are written into :class:`Rows` by the same call, so the next round reads them from the
device and nothing is uploaded per round.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.compile import Compiled, program_factory
from ssd_jax.drafters.model import draft_prefill
from ssd_jax.models import llama
from ssd_jax.models.llama import KVCache
from ssd_jax.sampling.filters import RowSampling, sample
from ssd_jax.sampling.logprobs import apply_min_tokens, columns_if_wanted


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """Per-row round state on one mesh (every array has the batch as its first axis)."""

    cur: jax.Array  # (B,) int32: the last emitted token, in no cache yet
    prev: jax.Array  # (B,) int32: the token before it (the draft's catch-up input)
    steps: jax.Array  # (B,) int32: rounds this row has run (folded into its key)
    keys: jax.Array  # (B, 2) uint32: each row's own key data
    limit: jax.Array  # (B,) int32: prompt length + max new tokens (rows past it are done by length)
    rs: RowSampling

    @staticmethod
    def empty(batch: int, n_ban: int) -> Rows:
        """Host arrays for ``batch`` free slots (greedy, no filter, no ban among ``n_ban`` ids, no
        log-probabilities)."""
        z = np.zeros(batch, np.int32)
        rs = RowSampling(
            np.zeros(batch, np.float32), z.copy(), np.ones(batch, np.float32), z.copy(),
            np.full((batch, n_ban), -1, np.int32), np.zeros(batch, bool),
        )  # fmt: skip
        return Rows(z.copy(), z.copy(), z + 1, np.zeros((batch, 2), np.uint32), z.copy(), rs)

    @property
    def key_batch(self) -> jax.Array:
        return jax.random.wrap_key_data(self.keys)


def set_rows(rows: Rows, slots_R, new: Rows) -> Rows:
    """``rows`` with slots ``slots_R`` replaced by the R rows of ``new``."""
    return jax.tree.map(lambda x, y: x.at[slots_R].set(y.astype(x.dtype)), rows, new)


@functools.partial(jax.jit, donate_argnums=(0,))
def restore_row(rows: Rows, vals) -> Rows:
    """``rows`` with slot ``vals[0]``'s (cur, prev, steps) set to ``vals[1:]`` (a preempted sequence
    resumed)."""
    b = vals[0]
    return dataclasses.replace(
        rows,
        cur=rows.cur.at[b].set(vals[1]),
        prev=rows.prev.at[b].set(vals[2]),
        steps=rows.steps.at[b].set(vals[3]),
    )


def gather_rows(cache: KVCache, slots_R, starts_R, whole: bool) -> KVCache:
    """Rows ``slots_R`` of ``cache`` as a batch of R, their lengths set to ``starts_R``. ``whole``
    (static): the slots are every row in order, so nothing is copied."""
    if whole:
        return cache.with_lengths(starts_R)
    start = None if cache.start is None else cache.start[slots_R]
    if cache.pages is not None:  # paged: the rows' block tables, the pool itself (nothing copied)
        return KVCache(cache.k, cache.v, starts_R, cache.window, cache.pages[slots_R], start)
    return KVCache(
        [x[slots_R] for x in cache.k], [x[slots_R] for x in cache.v], starts_R, cache.window, None, start
    )


def scatter_rows(cache: KVCache, rows: KVCache, slots_R, whole: bool) -> KVCache:
    """``cache`` with rows ``slots_R`` (and their lengths) replaced by ``rows``."""
    if whole:
        return rows
    start = None if cache.start is None else cache.start.at[slots_R].set(rows.start)
    lengths = cache.lengths.at[slots_R].set(rows.lengths)
    if cache.pages is not None:  # paged: the pool was written through the rows' tables
        return KVCache(rows.k, rows.v, lengths, cache.window, cache.pages, start)
    return KVCache(
        [x.at[slots_R].set(r) for x, r in zip(cache.k, rows.k)],
        [x.at[slots_R].set(r) for x, r in zip(cache.v, rows.v)],
        lengths,
        cache.window,
        None,
        start,
    )


def prefill_target(
    params, cache: KVCache, rows: Rows, tokens_RxC, n_valid_R, slots_R, starts_R, new: Rows, *, cfg, whole,
    greedy=False, needs_filter=True, capture=(),
):  # fmt: skip
    """Prefill one chunk of R prompts into slots ``slots_R`` (at offsets ``starts_R``), sample each
    row's next token from its own key at step 0, and write the rows' state (``new``, its ``cur`` the
    sampled token). Only the last chunk's token is a prompt's first generated token; earlier chunks'
    writes of ``cur`` are overwritten. A row with ``n_valid`` 0 (its prompt ended in an earlier chunk)
    keeps its length. Returns (tokens (R,), their log-probability columns (``columns_if_wanted``), cache,
    rows); with ``capture`` (static layer indices) also the chunk's features at those layers (R, C, n·D),
    what an EAGLE head reads (:mod:`ssd_jax.decoding.sd_eagle`)."""
    part = gather_rows(cache, slots_R, starts_R, whole)
    h, part, *feats = llama.forward(params, cfg, tokens_RxC, part, capture=capture)
    last = jnp.take_along_axis(h, jnp.maximum(n_valid_R - 1, 0)[:, None, None], axis=1)
    raw = llama.logits(params, cfg, last)  # (R, 1, V)
    lg = apply_min_tokens(raw, (starts_R + n_valid_R)[:, None], new.rs)[:, 0]
    if greedy:  # (static) every admitted row at temperature 0: the argmax, no draw
        tok = jnp.argmax(lg, axis=-1).astype(jnp.int32)
    else:
        tok = sample(jax.random.wrap_key_data(new.keys), lg, new.rs, needs_filter)
    tok = jnp.where(n_valid_R > 0, tok, rows.cur[slots_R])  # a prompt that ended earlier keeps its token
    cache = scatter_rows(cache, part.with_lengths(starts_R + n_valid_R), slots_R, whole)
    lpc = columns_if_wanted(raw, tok[:, None], new.rs)
    new = dataclasses.replace(new, cur=tok, steps=jnp.ones_like(new.steps))
    return (tok, lpc, cache, set_rows(rows, slots_R, new), *feats)


def prefill_draft(
    params, cache: KVCache, tokens_RxC, n_valid_R, slots_R, starts_R, *, cfg, whole, first=False
):
    """The draft's half of a prefill chunk: write the chunk into its cache rows (no sampling). ``first``
    (static; a cache with ``start``): the first chunk the draft sees of these rows, so each row's visible
    slots begin at this chunk (a draft context window: the chunks before it were skipped)."""
    part = gather_rows(cache, slots_R, starts_R, whole)
    if first:
        part = dataclasses.replace(part, start=starts_R.astype(jnp.int32))
    part = draft_prefill(params, part, tokens_RxC, n_valid_R, cfg=cfg)
    return scatter_rows(cache, part, slots_R, whole)


def park(cache: KVCache | None, active_B) -> KVCache | None:
    """Free slots keep length 0, so a slot never runs past its cache while it waits for a sequence."""
    return None if cache is None else cache.with_lengths(jnp.where(active_B, cache.lengths, 0))


def take_rows(tree, b: int | None):
    """The first ``b`` rows of every array in ``tree`` (a batch bucket); ``b`` None: ``tree`` itself."""
    return tree if b is None else jax.tree.map(lambda x: x[:b], tree)


def put_rows(full, part, b: int | None):
    """``full`` with its first ``b`` rows replaced by ``part`` (the inverse of :func:`take_rows`)."""
    return part if b is None else jax.tree.map(lambda f, p: f.at[:b].set(p.astype(f.dtype)), full, part)


def pad_rows(x: jax.Array, batch: int) -> jax.Array:
    """A bucket's host array padded with zero rows to the whole batch (the rows past it are free slots)."""
    return x if x.shape[0] == batch else jnp.zeros((batch, *x.shape[1:]), x.dtype).at[: x.shape[0]].set(x)


def batch_buckets(max_batch: int, buckets: int) -> tuple[int, ...]:
    """The batch sizes a round is compiled for: ``max_batch`` halved ``buckets - 1`` times (at least 1)."""
    if buckets < 1:
        raise ValueError("buckets must be >= 1")
    return tuple(sorted({max(1, -(-max_batch // (1 << i))) for i in range(buckets)}))


def context_windows(max_len: int, buckets: int) -> tuple[int, ...]:
    """The attention windows an engine compiles (``KVCache.window``): ``max_len`` halved ``buckets - 1``
    times, each rounded up to a multiple of 16 and at least 32."""
    if buckets < 1:
        raise ValueError("buckets must be >= 1")
    return tuple(
        sorted({max_len} | {min(max_len, max(32, -(-(max_len >> i) // 16) * 16)) for i in range(buckets)})
    )


def windowed(fn, window: int | None, cache_args=(1, 3)):
    """``fn`` with the KV caches among ``cache_args`` attending over their first ``window`` slots only, and
    every cache it returns back to the full window (so the stored caches keep one pytree structure).
    ``window`` None: ``fn`` itself."""
    if window is None:
        return fn

    def run(*args):
        args = [
            a.with_window(window) if i in cache_args and isinstance(a, KVCache) else a
            for i, a in enumerate(args)
        ]
        return jax.tree.map(
            lambda o: o.with_window(None) if isinstance(o, KVCache) else o,
            fn(*args),
            is_leaf=lambda o: isinstance(o, KVCache),
        )

    return run


@program_factory
def target_prefill_program(
    cfg, whole: bool, window: int | None, greedy: bool = False, needs_filter: bool = True
) -> Compiled:
    fn = functools.partial(prefill_target, cfg=cfg, whole=whole, greedy=greedy, needs_filter=needs_filter)
    return Compiled(windowed(fn, window, cache_args=(1,)), donate_argnums=(1,), name="prefill")


@program_factory
def draft_prefill_program(cfg, whole: bool, window: int | None, first: bool = False) -> Compiled:
    fn = functools.partial(prefill_draft, cfg=cfg, whole=whole, first=first)
    return Compiled(windowed(fn, window, cache_args=(1,)), donate_argnums=(1,), name="draft_prefill")
