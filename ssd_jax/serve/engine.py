"""The serving engine: slots, the waiting queue and the round loop on one host thread.

See :mod:`ssd_jax.serve` for the design. The HTTP side talks to it through three calls:
:meth:`Engine.submit` (queue sequences; refuses when the queue is full), :meth:`Engine.cancel`
(a client went away) and :meth:`Engine.shutdown`. Each sequence reports through its ``sink``,
called on the engine thread with ``("text", new_text)`` and finally ``("done", Sequence)``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import secrets
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from ssd_jax.decoding.batch import RowState, eos_ids
from ssd_jax.decoding.spec import SpecConfig
from ssd_jax.decoding.ssd.loop import fanout_setup, layout_table
from ssd_jax.decoding.ssd.rounds import Control
from ssd_jax.decoding.ssd.tree import Opts
from ssd_jax.drafters.base import Proposal
from ssd_jax.drafters.ngram import ngram_proposals
from ssd_jax.errors import UserError
from ssd_jax.parallel.placement import cache_for, put_on
from ssd_jax.sampling.filters import RowSampling, SamplingParams
from ssd_jax.serve import programs


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


class EngineDead(Exception):
    """The engine thread stopped on an error: no request can be served any more (HTTP 503)."""


@dataclasses.dataclass
class Sequence:
    """One generated sequence (an API request with ``n`` samples makes ``n``)."""

    prompt_ids: list[int]
    sampling: SamplingParams  # n = 1; this sequence's seed
    sink: Callable[[str, object], None]
    index: int = 0  # the sample's index in its request: folded into the key after the first
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    row: RowState | None = None
    cancelled: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error" (the engine failed)
    drafted: int = 0
    accepted: int = 0


def row_key(seed: int, index: int) -> np.ndarray:
    """The (2,) uint32 key data of a sequence: ``key(seed)``, with the sample index folded in after the first."""
    key = jax.random.key(seed)
    if index:
        key = jax.random.fold_in(key, index)
    return np.asarray(jax.random.key_data(key), np.uint32)


def fresh_seed() -> int:
    return secrets.randbits(63)


class Engine:
    """``max_batch`` slots over one static batch; one thread admits, runs rounds and streams."""

    def __init__(
        self,
        model,
        spec: SpecConfig,
        *,
        max_batch: int,
        max_len: int,
        prefill_chunk: int = 64,
        max_waiting: int = 64,
        drafter_model=None,
        metrics=None,
        context_buckets: int = 4,
    ):
        if spec.method not in ("ar", "sd", "ssd"):
            raise UserError(f"unknown method {spec.method!r} (ar, sd, ssd)")
        if spec.method == "sd" and spec.draft == "random":
            raise UserError("the server's SD drafters are a draft model or ngram")
        if spec.method == "ssd" and (drafter_model is None or spec.backup not in ("neural", "auto")):
            raise UserError(
                "the server's SSD needs a draft model and runs the neural backup (--backup neural; "
                "auto means neural here)"
            )
        if spec.method != "ar" and (spec.target_devices is not None or spec.draft_devices is not None):
            raise UserError(
                "the server runs both models on one device (no --target-devices / --draft-devices)"
            )
        self.model, self.spec, self.B, self.max_len = model, spec, max_batch, max_len
        self.C, self.max_waiting, self.metrics = prefill_chunk, max_waiting, metrics
        if spec.method != "ar" and spec.k == "auto":
            raise UserError(
                "the engine takes an integer k: resolve k='auto' first (ssd_jax.decoding.kauto.resolve_k)"
            )
        self.k = 0 if spec.method == "ar" else int(spec.k)
        self.kind = "model" if drafter_model is not None else "host"
        self.draft = drafter_model
        self.extra_slots = 0 if spec.method == "ar" else self.k + 1
        self.eos = eos_ids(model)
        dcfg = drafter_model.cfg if drafter_model is not None else None
        # attention windows: a round attends over the smallest that holds every running row's context
        self.windows = programs.context_windows(max_len, context_buckets)
        self._admit, self._rounds = programs.programs(
            model.cfg, dcfg, spec.method, self.k, self.kind, self.windows
        )
        self._put = functools.partial(put_on, model)

        B = max_batch
        self.slots: list[Sequence | None] = [None] * B
        self.waiting: collections.deque[Sequence] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self.error: str | None = None  # set when the engine thread failed: one line
        self._thread: threading.Thread | None = None
        # host copies of the per-row state, uploaded each round (a few (B,) arrays)
        self.cur = np.zeros(B, np.int32)
        self.prev = np.zeros(B, np.int32)
        self.steps = np.ones(B, np.int32)
        self.keys = np.zeros((B, 2), np.uint32)
        self.active = np.zeros(B, bool)
        self.temp = np.zeros(B, np.float32)
        self.top_k = np.zeros(B, np.int32)
        self.top_p = np.ones(B, np.float32)
        self.catch_up = False
        self.history: list[np.ndarray] = [np.zeros(0, np.int32)] * B
        self.tcache = cache_for(model, B, max_len)
        # SSD's draft cache also holds the speculation tree past the context (_ssd_setup)
        self.dcache = (
            cache_for(drafter_model, B, max_len)
            if drafter_model is not None and spec.method == "sd"
            else None
        )
        self.compile_s = 0.0
        if spec.method == "ssd":
            self._ssd_setup()

    def _ssd_setup(self) -> None:
        """SSD: the speculation (device-resident, with the draft distributions when a row samples), a
        fan-out schedule fixed at the estimator's prior (so a seeded request does not depend on the
        other rows' acceptance), and a draft cache with the speculation tree's region past the context."""
        uniform, M, est = fanout_setup(self.spec)
        K, B, cfg = self.k, self.B, self.model.cfg
        _, kb_tab, rb_tab = layout_table(est, K, M, uniform)
        fan = est.schedule(False)[:K]
        self._ctl = Control(k=K, budget=M, batch=B)
        self._ctrl_parts = (kb_tab, rb_tab, fan)
        self._fan = self._put(np.asarray(fan, np.int32))
        opts = Opts(
            k=K,
            budget=M,
            vocab=cfg.vocab_size,
            rand_vocab=cfg.vocab_size,
            needs_filter=False,
            greedy=True,
            c=float(self.spec.saguaro_c),
            tree_base=self.max_len,
        )
        self._first, self._rounds = programs.ssd_programs(cfg, self.draft.cfg, opts, self._ctl, self.windows)
        self.dcache = cache_for(self.draft, B, self.max_len + M * K)
        z = np.zeros(B, np.int32)
        self.sp = Proposal(
            self._put(np.zeros((B, K), np.int32)), self._put(z + K), None, self._put(z.astype(bool))
        )
        self.budget = M

    # --- start-up: every program the loop will call, compiled now

    def compile_all(self) -> float:
        p = self._put
        dparams = self.draft.params if self.draft is not None else None
        rs1 = self._rs(np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32))
        for admit in self._admit.values():
            self.compile_s += admit.precompile(
                self.model.params,
                self.tcache,
                dparams,
                self.dcache,
                p(np.zeros((1, self.C), np.int32)),
                p(np.ones(1, np.int32)),
                p(np.int32(0)),
                p(np.int32(0)),
                p(np.zeros((1, 2), np.uint32)),
                rs1,
            )
        if self.spec.method == "ssd":
            return self._ssd_compile(rs1)
        for prog in self._rounds.values():
            self.compile_s += prog.precompile(*self._round_args())
        return self.compile_s

    def _ssd_compile(self, rs1) -> float:
        p = self._put
        for greedy, prog in self._first.items():
            self.compile_s += prog.precompile(
                self.draft.params,
                self.dcache,
                self._ssd_spec(greedy),
                p(np.zeros(1, np.int32)),
                p(np.int32(0)),
                p(np.zeros((1, 2), np.uint32)),
                rs1,
                self._fan,
            )
        for (greedy, _, _), prog in self._rounds.items():
            self.compile_s += prog.precompile(*self._ssd_round_args(greedy))
        return self.compile_s

    def _ssd_spec(self, greedy: bool) -> Proposal:
        """The batch's speculation as the next program wants it: no q for a greedy one; for a sampling
        one, q = all -inf (the point-mass rule) for rows whose speculation was drafted greedily."""
        sp = self.sp
        if greedy and sp.q is not None:
            sp = Proposal(sp.tokens, sp.n_draft, None, sp.hit)
        elif not greedy and sp.q is None:
            q = self._put(np.full((self.B, self.k, self.model.cfg.vocab_size), -np.inf, np.float32))
            sp = Proposal(sp.tokens, sp.n_draft, q, sp.hit)
        self.sp = sp
        return sp

    def _ssd_round_args(self, greedy: bool):
        p = self._put
        rs = self._rs(self.temp, self.top_k, self.top_p)
        ctrl = p(self._ctl.pack(*self._ctrl_parts, self.active))
        return (
            self.model.params,
            self.tcache,
            self.draft.params,
            self.dcache,
            p(self.cur),
            self._ssd_spec(greedy),
            p(self.keys),
            p(self.steps),
            p(self.active),
            rs,
            ctrl,
        )

    def _rs(self, t, k, pp) -> RowSampling:
        return RowSampling(self._put(t), self._put(k), self._put(pp))

    def _round_args(self, host_toks=None, host_n=None):
        p = self._put
        rs = self._rs(self.temp, self.top_k, self.top_p)
        keys, steps, active = p(self.keys), p(self.steps), p(self.active)
        if self.spec.method == "ar":
            return (self.model.params, self.tcache, p(self.cur), keys, steps, active, rs)
        B, K = self.B, self.k
        if host_toks is None:
            host_toks, host_n = np.zeros((B, K), np.int32), np.zeros(B, np.int32)
        dparams = self.draft.params if self.draft is not None else None
        return (
            self.model.params,
            self.tcache,
            dparams,
            self.dcache,
            p(self.cur),
            p(self.prev),
            p(np.bool_(self.catch_up)),
            keys,
            steps,
            active,
            rs,
            p(host_toks),
            p(host_n),
        )

    # --- the HTTP side's calls (any thread)

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        need = n_prompt + max_tokens + self.extra_slots
        if need > self.max_len:
            raise UserError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the server's context of "
                f"{self.max_len - self.extra_slots} tokens"
            )

    def submit(self, seqs: list[Sequence]) -> None:
        with self._cv:
            if self.error is not None:
                raise EngineDead(f"the engine failed: {self.error}")
            if self._stop:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} sequences)")
            self.waiting.extend(seqs)
            self._gauges()
            self._cv.notify()

    def cancel(self, seqs: list[Sequence]) -> None:
        """Mark sequences cancelled; a waiting one never starts, a running one frees its slot next round."""
        with self._cv:
            for s in seqs:
                s.cancelled = True
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ssd_jax-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, cancel what is left, and join the loop."""
        with self._cv:
            self._stop = True
            for s in list(self.waiting) + [s for s in self.slots if s is not None]:
                s.cancelled = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    # --- the engine thread

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(self.running)
            self.metrics.waiting.set(len(self.waiting))

    def _loop(self) -> None:
        try:
            self._rounds_until_stopped()
        except Exception as e:  # noqa: BLE001 - a device or host failure: fail every request, stay up for /health
            self._die(e)

    def _die(self, e: Exception) -> None:
        """Every sequence in a slot or waiting ends with ``error``; later submissions get :class:`EngineDead`."""
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        print(f"[serve] engine failed: {msg}", file=sys.stderr, flush=True)
        with self._cv:
            self.error, self._stop = msg, True
            pending = [s for s in self.slots if s is not None] + list(self.waiting)
            self.slots, self.waiting = [None] * self.B, collections.deque()
            self.active[:] = False
            self._gauges()
        for s in pending:
            self._finish(s, "error")

    def _rounds_until_stopped(self) -> None:
        while True:
            with self._cv:
                self._drop_cancelled()
                while not self._stop and not self.waiting and not self.active.any():
                    self._cv.wait(0.5)
                if self._stop and not self.active.any():
                    self._drop_cancelled()
                    return
                admit = []
                while self.waiting and None in self.slots:
                    s = self.waiting.popleft()
                    if s.cancelled:
                        self._finish(s, "cancelled")
                        continue
                    b = self.slots.index(None)
                    self.slots[b] = s
                    admit.append((b, s))
                self._gauges()
            for b, s in admit:
                self._admit_one(b, s)
            if self.active.any():
                self._round()
            with self._cv:
                self._gauges()

    def _drop_cancelled(self) -> None:
        for b, s in enumerate(self.slots):
            if s is not None and s.cancelled:
                self._free(b, "cancelled")
        kept = collections.deque()
        for s in self.waiting:
            if s.cancelled:
                self._finish(s, "cancelled")
            else:
                kept.append(s)
        self.waiting = kept

    def _admit_one(self, b: int, s: Sequence) -> None:
        p, sp, ids = self._put, s.sampling, s.prompt_ids
        key = row_key(sp.seed, s.index)
        rs1 = self._rs(
            np.array([sp.temperature], np.float32),
            np.array([sp.top_k], np.int32),
            np.array([sp.top_p], np.float32),
        )
        dparams = self.draft.params if self.draft is not None else None
        tok = None
        for start in range(0, len(ids), self.C):
            chunk = ids[start : start + self.C]
            block = np.zeros((1, self.C), np.int32)
            block[0, : len(chunk)] = chunk
            tok, self.tcache, self.dcache = self._admit[self._window(start + self.C)](
                self.model.params,
                self.tcache,
                dparams,
                self.dcache,
                p(block),
                p(np.array([len(chunk)], np.int32)),
                p(np.int32(b)),
                p(np.int32(start)),
                p(key[None]),
                rs1,
            )
        first = int(np.asarray(tok)[0])
        if self.spec.method == "ssd":  # the row's first speculation, drafted now
            greedy = self.sp.q is None and sp.temperature == 0
            self.sp, self.dcache = self._first[greedy](
                dparams,
                self.dcache,
                self._ssd_spec(greedy),
                p(np.array([first], np.int32)),
                p(np.int32(b)),
                p(key[None]),
                rs1,
                self._fan,
            )
        self.keys[b], self.steps[b], self.active[b] = key, 1, True
        self.temp[b], self.top_k[b], self.top_p[b] = sp.temperature, sp.top_k, sp.top_p
        self.cur[b], self.prev[b] = first, ids[-1]
        if self.kind == "host":
            self.history[b] = np.asarray(ids + [first], np.int32)
        s.row = RowState(None, ids, self.model, sp, self.eos)
        s.first_token_at = time.perf_counter()
        self._push(b, [first])

    def _push(self, b: int, toks) -> None:
        """Hand a row its new tokens; streams text, frees the slot when the sequence ends."""
        s = self.slots[b]
        for t in toks:
            new = s.row.push(int(t))
            if new:
                s.sink("text", new)
            if s.row.done:
                self._free(b, {"eos": "stop"}.get(s.row.finish_reason, s.row.finish_reason))
                return

    def _free(self, b: int, reason: str) -> None:
        s = self.slots[b]
        self.slots[b] = None
        self.active[b] = False
        self.temp[b], self.top_k[b], self.top_p[b] = 0.0, 0, 1.0
        self._finish(s, reason)

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finish_reason = reason
        s.finished_at = time.perf_counter()
        if self.metrics is not None:
            self.metrics.sequence_done(s)
        s.sink("done", s)

    def _window(self, need: int) -> int:
        """The smallest compiled attention window of at least ``need`` slots."""
        return next((w for w in self.windows if w >= need), self.windows[-1])

    def _round_window(self) -> int:
        """The window of this round: every running row's cache slots, with the round's writes, lie below it."""
        need = max(
            len(s.prompt_ids) + len(s.row.tokens) for s in self.slots if s is not None and s.row is not None
        )
        return self._window(need + self.extra_slots + 1)

    def _round(self) -> None:
        live = self.active.copy()
        needs_filter = bool(((self.top_k > 0) | (self.top_p < 1.0))[live].any())
        w = self._round_window()
        if self.spec.method == "ssd":
            return self._ssd_round(live, needs_filter, w)
        prog = self._rounds[needs_filter, w]
        if self.spec.method == "ar":
            tok, self.tcache = prog(*self._round_args())
            toks = np.asarray(tok)
            self.cur[:] = toks
            self.steps += 1
            for b in np.flatnonzero(live):
                self._push(b, [toks[b]])
            return
        host_toks = host_n = None
        if self.kind == "host":
            host_toks, host_n = ngram_proposals(
                self.history,
                self.k,
                self.spec.prompt_lookup_min,
                self.spec.prompt_lookup_max,
                rows=np.flatnonzero(live),
            )
        out, self.tcache, self.dcache, cur, prev = prog(*self._round_args(host_toks, host_n))
        out = np.asarray(out)
        emitted, n_acc = out[:, :-1], out[:, -1]
        n_draft = host_n if host_n is not None else np.full(self.B, self.k, np.int32)
        self.cur[:], self.prev[:] = np.asarray(cur), np.asarray(prev)
        self.steps += 1
        self.catch_up = bool((n_acc >= n_draft)[live].any())
        if self.metrics is not None:
            self.metrics.spec_round(n_acc[live], n_draft[live])
        for b in np.flatnonzero(live):
            new = emitted[b, : n_acc[b] + 1]
            s = self.slots[b]
            s.drafted += int(n_draft[b])
            s.accepted += int(n_acc[b])
            if self.kind == "host":
                self.history[b] = np.concatenate([self.history[b], new])
            self._push(b, new)

    def _ssd_round(self, live, needs_filter: bool, window: int) -> None:
        greedy = bool((self.temp[live] == 0).all())
        K = self.k
        out, self.sp, self.tcache, self.dcache = self._rounds[greedy, needs_filter and not greedy, window](
            *self._ssd_round_args(greedy)
        )
        out = np.asarray(out)  # the round's one read
        emitted, n_acc, hit = out[:, : K + 1], out[:, K + 1], out[:, K + 2] > 0
        self.cur[:] = emitted[np.arange(self.B), n_acc]  # the last token emitted: the next round's cur
        self.steps += 1
        if self.metrics is not None:
            self.metrics.spec_round(n_acc[live], np.full(int(live.sum()), K))
        for b in np.flatnonzero(live):
            s = self.slots[b]
            s.drafted += K
            s.accepted += int(n_acc[b])
            self._push(b, emitted[b, : n_acc[b] + 1])
        # the lookup that made the next speculation, over the rows that go on
        going = live & self.active
        if self.metrics is not None:
            self.metrics.cache_lookup(int(going.sum()), int((hit & going).sum()))
