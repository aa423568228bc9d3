"""The one engine: slots, the waiting queue and the round driver, for every method, offline and served.

``generate()`` submits all its rows at time 0 and runs the engine until every row is done; the server
submits requests as they arrive and runs the same :meth:`Engine.step` on its engine thread. One step:

1. **admit** - waiting sequences take free slots; their prompts are prefilled into those slots' rows
   in chunks (all rows admitted together share each chunk call), and each samples its first token;
2. **dispatch** - the method queues one compiled round over every slot (free slots ride along,
   their results ignored), and, where the method allows it, the next round is queued before this
   one is read, so the device never waits for the host;
3. **read** - the round's tokens come to the host once: each row gets its tokens (detokenising,
   EOS / stop strings / length), streams text, and frees its slot when it ends.

A method (:mod:`ssd_jax.engine.methods`) supplies its compiled programs and typed round state; the
engine owns who runs where and when.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ssd_jax.decoding.batch import RowState, eos_ids, prompt_bucket
from ssd_jax.decoding.slots import Rows
from ssd_jax.decoding.stats import AcceptanceStats
from ssd_jax.sampling.filters import SamplingParams
from ssd_jax.sampling.logprobs import HostLogprobs


@dataclasses.dataclass
class Sequence:
    """One generated sequence (a prompt's sample; an API request with ``n`` samples makes ``n``)."""

    prompt_ids: list[int]
    sampling: SamplingParams  # n = 1; this sequence's seed
    sink: Callable[[str, object], None] | None = None  # ("text", new) and finally ("done", self)
    index: int = 0  # the sample's index in its request: folded into its key after the first
    prompt: Any = None  # what the caller passed (returned in the outputs)
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    row: RowState | None = None
    slot: int | None = None
    cancelled: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error" (the engine failed)
    drafted: int = 0
    accepted: int = 0
    preempted: int = 0  # times it gave its slot back (paged cache full) to be recomputed later
    resume: tuple | None = None  # preempted: its method's row state (cur, prev, step, ...) to continue from
    order: int = -1  # when it was (last) admitted: the newest is preempted first
    prefix_hit: int = 0  # paged: prompt tokens found in the prefix cache at its (last) admission
    uid: int = -1  # its number in a server under the launcher (how process 1 names it)
    # with sampling.logprobs: per token, (its log-probability, [(id, log-probability)] of the best alternatives)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    def key_data(self) -> np.ndarray:
        """The (2,) uint32 key of this sequence: ``key(seed)``, the sample index folded in after the first.
        Its tokens depend on this key alone, whatever shares its batch."""
        import jax

        key = jax.random.key(self.sampling.seed)
        if self.index:
            key = jax.random.fold_in(key, self.index)
        return np.asarray(jax.random.key_data(key), np.uint32)

    @property
    def context(self) -> int:
        return len(self.prompt_ids) + (len(self.row.tokens) if self.row is not None else 0)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a round samples: every live row greedy (argmax-only programs), or some row filters; and
    ``extras``: some row asks for log-probabilities or ``min_tokens`` (AR and SD compile those in only
    then, on first use in the server)."""

    greedy: bool
    needs_filter: bool
    extras: bool = False

    @staticmethod
    def of(samplings) -> Mode:
        sp = list(samplings)
        greedy = all(s.temperature == 0 for s in sp)
        extras = any(s.logprobs is not None or s.min_tokens > 0 for s in sp)
        return Mode(greedy, not greedy and any(s.needs_filter for s in sp), extras)


#: the modes a server compiles: greedy, and sampling with the filter (a round whose rows sample without
#: top-k / top-p runs the filtering program, which leaves their distributions unchanged)
ALL_MODES = (Mode(True, False), Mode(False, True))


@dataclasses.dataclass(frozen=True)
class RoundOut:
    """What a round gives the host: per slot, the emitted tokens and how many, what was drafted."""

    tokens: np.ndarray  # (B, W) int32
    n_emit: np.ndarray  # (B,) tokens emitted (accepted + 1)
    n_draft: np.ndarray  # (B,) proposals verified (0 for AR)
    hit: np.ndarray | None = None  # (B,) SSD: the verified speculation came from the cache
    logprobs: HostLogprobs | None = None  # when a row asked: the target's, per emitted token
    k: int | None = None  # SD: the round's K (0: an AR round)


@dataclasses.dataclass
class Pending:
    """A dispatched round: the method's handle and the slots' sequences when it was queued."""

    handle: Any
    seqs: list[Sequence | None]
    bucket: int = 0  # the rows it ran (its batch bucket)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One prefill call for the rows admitted together."""

    slots: np.ndarray  # (R,) int32
    tokens: np.ndarray  # (R, C) int32
    n_valid: np.ndarray  # (R,) int32 (0: the row's prompt ended in an earlier chunk)
    starts: np.ndarray  # (R,) int32
    whole: bool  # the slots are the whole batch, in order
    window: int


class Engine:
    """``max_batch`` slots over one static batch; :meth:`step` admits, runs a round and streams.

    ``prefill_chunk``: prompt tokens per prefill call (None: a whole prompt, padded to a power of two);
    ``admit_together``: rows admitted in the same step share their prefill calls (offline: all rows at
    time 0 in one call); ``context_buckets``: attention windows compiled (``slots.context_windows``);
    ``batch_buckets``: batch sizes compiled (``slots.batch_buckets``): a round runs the smallest that
    holds every running row (admission takes the lowest free slot), where the method allows it."""

    def __init__(
        self,
        method,
        *,
        max_batch: int,
        max_len: int,
        prefill_chunk: int | None = None,
        max_waiting: int | None = None,
        metrics=None,
        context_buckets: int = 1,
        admit_together: bool = True,
        batch_buckets: int = 1,
        kv_blocks: int | None = None,
        block_size: int | None = None,
        prefix_caching: bool = True,
    ):
        from ssd_jax.decoding.slots import batch_buckets as batch_buckets_of
        from ssd_jax.decoding.slots import context_windows

        self.method, self.B, self.max_len = method, max_batch, max_len
        self.model = method.model
        self.C, self.max_waiting, self.metrics = prefill_chunk, max_waiting, metrics
        self.admit_together = admit_together
        self.windows = context_windows(max_len, context_buckets)
        self.buckets = batch_buckets_of(max_batch, batch_buckets)
        self.extra_slots = method.extra_slots
        self.eos = eos_ids(self.model)
        self.ban = np.array(sorted(self.eos) or [-1], np.int32)  # what min_tokens bans
        self.slots: list[Sequence | None] = [None] * max_batch
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.pending: Pending | None = None
        self.stats = AcceptanceStats(max_batch, method.k_max)
        self.rounds = 0
        self.last_k: int | None = None  # the last round's K where the method varies it (SD)
        self.bucket_rounds: collections.Counter[int] = (
            collections.Counter()
        )  # rounds dispatched per batch size
        self.pages = self.paged = None
        if kv_blocks is not None and method.pageable:
            from ssd_jax.engine.blocks import BLOCK_SIZE, BlockPool, Pages

            from ssd_jax.errors import UserError

            bs = block_size or BLOCK_SIZE
            if kv_blocks * bs < max_len:
                raise UserError(
                    f"--kv-blocks {kv_blocks} of {bs} slots hold fewer than one sequence's {max_len} slots"
                )
            self.paged = (kv_blocks, bs)
            self.pages = Pages(BlockPool(kv_blocks, bs, prefix_caching), max_batch, max_len)
        self.preemptions = 0
        self._admitted = 0  # admissions so far (the newest running sequence is preempted first)
        self.compile_s = method.setup(self)
        if not admit_together:  # a server: the sequences' keys too (jax.random compiles at first use)
            for index in (0, 1):
                Sequence([0], SamplingParams(), index=index).key_data()

    def admission_chunks(self) -> list[Chunk]:
        """One row's prefill chunk at each window: the shapes of a server's admissions (one row each),
        for its methods to compile before it serves."""
        one = np.zeros(1, np.int32)
        return [Chunk(one, np.zeros((1, self.C), np.int32), one, one, self.B == 1, w) for w in self.windows]

    # --- the caller's side

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        from ssd_jax.errors import UserError

        if n_prompt + max_tokens + self.extra_slots > self.max_len:
            raise UserError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the engine's context of "
                f"{self.max_len - self.extra_slots} tokens"
            )

    def submit(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.check_fits(len(s.prompt_ids), s.sampling.max_new_tokens)
        self.waiting.extend(seqs)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    def busy(self) -> bool:
        return bool(self.waiting) or self.running > 0 or self.pending is not None

    def run(self) -> None:
        """Step until every submitted sequence is done."""
        while self.busy():
            self.step()

    # --- one step of the driver

    def step(self) -> None:
        self._drop_cancelled()
        self.admit()
        if self.pending is None:
            if self.running == 0:
                return
            self.pending = self._dispatch(0)
            if self.pending is None:  # every running sequence was preempted (a pool smaller than a row)
                return
        rnd, self.pending = self.pending, None
        if self._worth_queueing(1) and self.method.queues_ahead():
            self.pending = self._dispatch(1)  # round T+1 queued before round T is read (None: no blocks)
        live = np.array(
            [s is not None and not s.row.done and self.slots[b] is s for b, s in enumerate(rnd.seqs)]
        )
        fresh = np.array([s is not None and s is not rnd.seqs[b] for b, s in enumerate(self.slots)])
        out = self.method.read(rnd.handle, live, fresh)  # fresh: admitted after this round was queued
        self._push_round(rnd, out, live)
        self.method.settle(np.array([s is not None and s is rnd.seqs[b] for b, s in enumerate(self.slots)]))
        if self.running == 0 and self.pending is not None and not self.waiting:
            self.method.drain(self.pending.handle)  # a round past the end: nothing runs into the caller
            self.pending = None

    def _worth_queueing(self, in_flight: int) -> bool:
        """Some running row still needs a token even if every round in flight gives it the most a round
        can (``k_max + 1``). A round queued past every row's end runs for nothing and is waited for (on
        the Qwen pair, where a round emits ~4 of 5 tokens, that was one round in eight); not queueing
        costs only the host's read of one round."""
        most = in_flight * (self.method.k_max + 1)
        return any(
            s is not None and not s.row.done and len(s.row.tokens) + most < s.sampling.max_new_tokens
            for s in self.slots
        )

    def _window(self, need: int) -> int:
        return next((w for w in self.windows if w >= need), self.windows[-1])

    def _dispatch(self, in_flight: int) -> Pending | None:
        """Queue a round with ``in_flight`` rounds ahead of it. Paged: every running row first gets the
        blocks the rounds may write; short of blocks, a round queued ahead is not queued (None), and
        otherwise the newest sequences are preempted until the others fit."""
        if self.pages is not None and (not self._grow(in_flight) or self.running == 0):
            return None
        seqs = list(self.slots)
        live = np.array([s is not None and not s.row.done for s in seqs])
        need = max(s.context for s in seqs if s is not None) + (in_flight + 1) * self.extra_slots + 1
        mode = Mode.of(seqs[b].sampling for b in np.flatnonzero(live))
        if mode not in self.method.modes:  # exact: the filter leaves unfiltered rows unchanged
            mode = Mode(mode.greedy, True, mode.extras)
        bucket = self.B
        if len(self.method.buckets) > 1:
            top = max(b for b, s in enumerate(seqs) if s is not None) + 1  # every running row lies below it
            bucket = next(b for b in self.method.buckets if b >= top)
        self.bucket_rounds[bucket] += 1
        self._sync_pages()
        return Pending(self.method.dispatch(live, self._window(need), mode, bucket), seqs, bucket)

    # --- the paged cache

    def _grow(self, in_flight: int) -> bool:
        """Blocks for what the next round may write in every running row (its context, the rounds in
        flight and this one at their largest); with no round in flight, preempting the newest sequences
        until the rest fit (one alone always fits: its blocks cover a whole row)."""
        while True:
            short = [
                b for b, s in enumerate(self.slots)
                if s is not None and not self.pages.grow(b, s.context + self._reach(in_flight))
            ]  # fmt: skip
            if not short:
                return True
            if in_flight:
                return False
            self._preempt(max((b for b, s in enumerate(self.slots) if s is not None), key=self._admission))

    def _reach(self, in_flight: int) -> int:
        """Slots past a row's context that the rounds in flight and the next one may write."""
        return in_flight * self.extra_slots + self.method.page_reach

    def _admission(self, b: int) -> int:
        return self.slots[b].order

    def _cached_tokens(self, s: Sequence) -> list[int]:
        """The tokens in ``s``'s cache rows: its prompt and every token but the last (``cur``)."""
        return list(s.prompt_ids) + (s.row.tokens[:-1] if s.row is not None else [])

    def _preempt(self, b: int) -> None:
        """Give slot ``b``'s sequence's blocks back and queue it first, to be recomputed: re-admitted, its
        prompt and tokens so far are prefilled (mostly from the prefix cache) and it continues from its
        last token at its own step, so it draws the same tokens as if never preempted."""
        s = self.slots[b]
        s.resume, s.preempted = self.method.row_state(b), s.preempted + 1
        cached = self._cached_tokens(s)
        self.pages.release(b, cached, len(cached))
        self.slots[b] = None
        self.waiting.appendleft(s)
        self.preemptions += 1
        if self.metrics is not None:
            self.metrics.preempted()

    def _sync_pages(self) -> None:
        if self.pages is not None and (table := self.pages.take_table()) is not None:
            self.method.set_pages(table)
            if self.metrics is not None:  # the table changes as blocks are taken and given back
                self.metrics.kv_usage.set(self.pages.pool.usage)

    def _push_round(self, rnd: Pending, out: RoundOut, live: np.ndarray) -> None:
        self.rounds += 1
        self.last_k = out.k  # (the server's processes compare it after every step: serve/lockstep.py)
        if self.method.speculates:
            self.stats.update(live, out.n_emit - 1, out.n_draft, hit=out.hit)
            if self.metrics is not None:
                self.metrics.spec_round(out.n_emit[live] - 1, out.n_draft[live], out.k, rnd.bucket)
        for b in np.flatnonzero(live):
            s = rnd.seqs[b]
            s.drafted += int(out.n_draft[b])
            s.accepted += int(out.n_emit[b] - 1)
            self._push(b, out.tokens[b, : out.n_emit[b]], out.logprobs)

    def _push(self, b: int, toks, lps: HostLogprobs | None) -> None:
        s = self.slots[b]
        for j, t in enumerate(np.asarray(toks).tolist()):
            if s.logprobs is not None and lps is not None:
                s.logprobs.append(lps.token(b, j, s.sampling.logprobs))
            new = s.row.push(int(t))
            if new and s.sink is not None:
                s.sink("text", new)
            if s.row.done:
                self._free(b, {"eos": "stop"}.get(s.row.finish_reason, s.row.finish_reason))
                return

    def _free(self, b: int, reason: str) -> None:
        s = self.slots[b]
        self.slots[b] = None
        if self.pages is not None:  # its full blocks stay cached for later prompts that share them
            cached = self._cached_tokens(s)
            self.pages.release(b, cached, len(cached))
        self._finish(s, reason)

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finish_reason = reason
        s.finished_at = time.perf_counter()
        if self.metrics is not None:
            self.metrics.sequence_done(s)
        if s.sink is not None:
            s.sink("done", s)

    def _drop_cancelled(self) -> None:
        for b, s in enumerate(self.slots):
            if s is not None and s.cancelled:
                self._free(b, "cancelled")

    def fail_all(self, reason: str = "error") -> None:
        """Every sequence in a slot or waiting ends with ``reason`` (the engine failed)."""
        if self.pages is not None:
            for b, s in enumerate(self.slots):
                if s is not None:
                    self.pages.release(b, [], 0)
        pending = [s for s in self.slots if s is not None] + list(self.waiting)
        self.slots, self.waiting, self.pending = [None] * self.B, collections.deque(), None
        for s in pending:
            self._finish(s, reason)

    # --- admission

    def admit(self) -> None:
        """Waiting sequences into free slots (their prompts prefilled, first tokens pushed)."""
        free = [b for b, s in enumerate(self.slots) if s is None]
        group: list[tuple[int, Sequence]] = []
        while self.waiting and free:  # the waiting deque may grow from another thread meanwhile
            s = self.waiting.popleft()
            if s.cancelled:
                self._finish(s, "cancelled")
                continue
            if self.pages is not None:
                tokens = self._cached_tokens(s) if s.resume is not None else s.prompt_ids
                hit = self.pages.admit(free[0], tokens, self._reach(1))
                if hit is None:  # too few blocks free: it waits (first) for a sequence to end
                    self.waiting.appendleft(s)
                    break
                s.prefix_hit = hit
            group.append((free.pop(0), s))
            if not self.admit_together:
                self._admit_group(group)
                group = []
        if group:
            self._admit_group(group)

    def _admit_group(self, group: list[tuple[int, Sequence]]) -> None:
        slots = np.array([b for b, _ in group], np.int32)
        seqs = [s for _, s in group]
        new = self._new_rows(seqs)
        prompts = [self._cached_tokens(s) if s.resume is not None else s.prompt_ids for s in seqs]
        hits = [s.prefix_hit for s in seqs] if self.pages is not None else None
        self._sync_pages()
        first, lps = self.method.admit(self.chunks(slots, prompts, hits), new)
        self.method.admitted(slots.tolist(), prompts, first.tolist())
        if self.pages is not None:
            for b, p in zip(slots.tolist(), prompts):
                self.pages.name(b, p, len(p))  # the prompt's full blocks, for later prompts to share
            if self.metrics is not None:
                self.metrics.prefix_cache(self.pages.pool)
        now = time.perf_counter()
        for r, ((b, s), tok) in enumerate(zip(group, first.tolist())):
            self.slots[b] = s
            s.slot, s.order = b, self._admitted
            self._admitted += 1
            if (
                s.resume is not None
            ):  # a preempted sequence: it continues where it was (its first token is not new)
                self.method.restore(b, s.resume, s.row.tokens[-1])
                s.resume = None
                continue
            s.row = RowState(s.prompt, s.prompt_ids, self.model, s.sampling, self.eos)
            s.first_token_at = now
            if s.sampling.logprobs is not None:
                s.logprobs = [lps.token(r, 0, s.sampling.logprobs)]
            self._push(b, [tok], None)

    def _new_rows(self, seqs: list[Sequence]) -> Rows:
        """The admitted rows' state on the host (``cur`` is filled in by the prefill)."""
        from ssd_jax.sampling.filters import RowSampling

        f32, i32 = np.float32, np.int32
        return Rows(
            cur=np.zeros(len(seqs), i32),
            prev=np.array([s.prompt_ids[-1] for s in seqs], i32),
            steps=np.ones(len(seqs), i32),
            keys=np.stack([s.key_data() for s in seqs]),
            limit=np.array([len(s.prompt_ids) + s.sampling.max_new_tokens for s in seqs], i32),
            rs=RowSampling(
                np.array([s.sampling.temperature for s in seqs], f32),
                np.array([s.sampling.top_k for s in seqs], i32),
                np.array([s.sampling.top_p for s in seqs], f32),
                min_end=np.array(
                    [len(s.prompt_ids) + s.sampling.min_tokens if s.sampling.min_tokens else 0 for s in seqs],
                    i32,
                ),
                ban=np.tile(self.ban, (len(seqs), 1)),
                want_logprobs=np.array([s.sampling.logprobs is not None for s in seqs]),
            ),
        )

    def chunks(
        self, slots: np.ndarray, prompts: list[list[int]], skip: list[int] | None = None
    ) -> list[Chunk]:
        """The prefill calls of rows admitted together: chunk j holds tokens [o + j*C, o + (j+1)*C) of each
        prompt, o its ``skip`` (tokens already cached: a shared prefix; default 0), the width the chunk
        size (or, for whole prompts, the longest rest padded to a power of two)."""
        lens = np.array([len(p) for p in prompts], np.int32)
        offs = np.zeros(len(prompts), np.int32) if skip is None else np.asarray(skip, np.int32)
        whole = len(slots) == self.B and bool((slots == np.arange(self.B)).all())
        out, j = [], 0
        rest_max = int((lens - offs).max())
        while j < rest_max:
            width = self.C if self.C is not None else prompt_bucket(rest_max - j)
            tokens = np.zeros((len(slots), width), np.int32)
            begin = offs + j
            n_valid = np.clip(lens - begin, 0, width).astype(np.int32)
            for r, p in enumerate(prompts):
                tokens[r, : n_valid[r]] = p[begin[r] : begin[r] + n_valid[r]]
            starts = np.where(n_valid > 0, begin, lens).astype(np.int32)
            out.append(Chunk(slots, tokens, n_valid, starts, whole, self._window(int(begin.max()) + width)))
            j += width
        return out
