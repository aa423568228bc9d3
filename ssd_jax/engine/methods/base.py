"""What every method shares: the target's side of the slots (its cache, its per-row state, admission
by chunked prefill), the sampling mode of a round, and the AR method itself."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from ssd_jax.compile import Compiled, programs
from ssd_jax.decoding import runtime
from ssd_jax.decoding.slots import Rows, target_prefill_program
from ssd_jax.engine.core import RoundOut
from ssd_jax.parallel.placement import cache_for, put_on


#: (greedy, needs_filter) of a prefill program, by the sampling of the rows admitted: argmax, a plain
#: draw, a draw through top-k / top-p
PREFILL_SAMPLINGS = ((True, False), (False, False), (False, True))


def chunk_args(c, put) -> tuple:
    """A prefill chunk's arrays as the prefill programs take them, placed by ``put``."""
    return put(c.tokens), put(c.n_valid), put(c.slots), put(c.starts)


class Method:
    """The target's side of every method, and the interface the engine (:mod:`ssd_jax.engine.core`,
    :mod:`ssd_jax.engine.generate`) and the server call: everything they call or read on a method is
    declared here. Subclasses add their draft side and round programs (:meth:`compile_rounds`,
    :meth:`dispatch`, :meth:`read`) and override what else they need."""

    name: str  # the method's name in results and metrics ("ar", "sd", "ssd"): every subclass sets it
    speculates = False
    k_max = 0
    extra_slots = 0
    bucketed = False  # runs a round over the first rows only (batch buckets); else every slot, always
    pageable = False  # its caches may be paged (ssd_jax.engine.blocks)
    draft = None  # the draft model where the method runs one (its context must hold the batch too)
    M = 0  # SSD's fan-out budget: the branches a round's speculation tree may hold (0: no tree)

    @property
    def page_reach(self) -> int:
        """Slots past a row's context (its tokens and cur) one round may write (blocks it must hold)."""
        return self.extra_slots + 1

    def __init__(self, model, modes):
        self.model, self.modes = model, tuple(modes)
        self.put = functools.partial(put_on, model)
        self._active_h: np.ndarray | None = None
        self._active = None
        self._plain_rs = None  # (the rows' rs, the same without min_tokens / logprobs fields)
        self.ar_buckets: set[int] = set()  # the batch buckets that run AR rounds (SSD's per-bucket switch)
        self.bucket_costs: dict[int, dict] = {}  # per bucket, the timed round costs that chose them

    def setup(self, engine) -> float:
        """Allocate the caches and state for ``engine.B`` slots; compile the round programs. Returns the
        seconds spent compiling."""
        t0 = Compiled.total_s
        self.B, self.max_len, self.n_ban = engine.B, engine.max_len, len(engine.ban)
        self.buckets = engine.buckets if self.bucketed else (self.B,)
        self.paged = engine.paged if self.pageable else None
        self.tcache = cache_for(self.model, self.B, self.max_len, self.paged)
        self.rows = jax.tree.map(self.put, Rows.empty(self.B, self.n_ban))
        with programs().held_by(self):  # every program warmed here stays while this method lives
            self.setup_draft(engine)
            self.compile_rounds(engine.windows)
            if not engine.admit_together and engine.C is not None:  # a server: what its admissions run
                self.compile_admission(engine.admission_chunks())
        return Compiled.total_s - t0

    def setup_draft(self, engine) -> None:
        """Allocate the draft side's caches and state (before :meth:`compile_rounds`); none by default."""

    def compile_rounds(self, windows) -> None:
        """Compile every round program :meth:`dispatch` may run: at each context window in ``windows``,
        each batch bucket and each sampling mode of the method."""
        raise NotImplementedError

    def dispatch(self, live, window, mode, bucket=None):
        """Queue one round over the slots ``live`` (a host mask) with attention window ``window``, sampling
        ``mode`` and batch ``bucket`` (None: every slot), without waiting for it; returns its handle, for
        :meth:`read` or :meth:`drain`."""
        raise NotImplementedError

    def read(self, handle, live, fresh) -> RoundOut:
        """The round ``handle`` on the host: per slot, its emitted tokens and what was drafted. ``live``: the
        slots whose sequences the round ran and still run; ``fresh``: the slots admitted after it was
        queued."""
        raise NotImplementedError

    def settle(self, going: np.ndarray) -> None:
        """After a round's tokens reached the rows: ``going`` marks the slots that still hold the sequence
        the round ran (statistics counted for the rows whose next round verifies them). Nothing by
        default."""

    def row_metrics(self, b: int) -> dict:
        """Slot ``b``'s own metrics, beside the engine's in an offline row's output; none by default."""
        return {}

    def bucket_note(self) -> str:
        """The server's start-up line's account of the method's batch buckets; empty by default."""
        return ""

    def compile_admission(self, chunks) -> None:
        """Compile what admitting one row runs (a server admits each request on its own; ``chunks``: a
        one-row chunk at each window), so that a warm server's first admissions compile nothing: the
        target's prefill for each window and each kind of sampling the row may ask for."""
        new = jax.tree.map(self.put, Rows.empty(1, self.n_ban))
        for c in chunks:
            for greedy, nf in PREFILL_SAMPLINGS:
                prog = target_prefill_program(self.model.cfg, c.whole, self.window(c.window), greedy, nf)
                prog.precompile(self.model.params, self.tcache, self.rows, *chunk_args(c, self.put), new)

    def set_pages(self, table: np.ndarray) -> None:
        """A new block table (paged caches): each cache gets its own copy (the caches are donated)."""
        self.tcache = dataclasses.replace(self.tcache, pages=self.put(table))

    def row_state(self, b: int) -> tuple[int, int, int]:
        """Slot ``b``'s (cur, prev, step) on the host (a preemption; no round in flight)."""
        r = self.rows
        return int(np.asarray(r.cur)[b]), int(np.asarray(r.prev)[b]), int(np.asarray(r.steps)[b])

    def restore(self, b: int, state, cur: int) -> None:
        """Slot ``b`` continues a preempted sequence: ``state`` (what :meth:`row_state` gave) as it was
        (after the re-admission's prefill, whose sampled token is not used); ``cur`` its last token."""
        from ssd_jax.decoding.slots import restore_row

        self.rows = restore_row(self.rows, self.put(np.array([b, *state], np.int32)))

    def window(self, w: int) -> int | None:
        """A round's attention window; None when it is the whole cache (no windowing)."""
        return None if w >= self.max_len else w

    def round_rows(self, mode) -> Rows:
        """The rows a round program reads: without the ``min_tokens`` ban and the log-probability flag
        when no running row needs them (``mode.extras``), so the program has neither (a static choice:
        the pytree differs)."""
        r = self.rows
        if mode.extras:
            return r
        if self._plain_rs is None or self._plain_rs[0] is not r.rs:  # the rows' rs change on admission only
            rs = r.rs
            self._plain_rs = (rs, type(rs)(rs.temperature, rs.top_k, rs.top_p))
        return Rows(r.cur, r.prev, r.steps, r.keys, r.limit, self._plain_rs[1])

    def bucket(self, b: int | None) -> int | None:
        """A round's batch bucket; None when it is every slot."""
        return None if b is None or b >= self.B else b

    def active(self, live: np.ndarray):
        """The live mask on the device, uploaded only when it changes."""
        if self._active_h is None or not np.array_equal(live, self._active_h):
            self._active_h, self._active = live.copy(), self.put(live)
        return self._active

    def admit_target(self, chunks, new: Rows):
        """Prefill the chunks into the target's rows and write the rows' state; returns the first tokens
        (R,) on the target's mesh."""
        new_d = jax.tree.map(self.put, new)
        greedy = bool((new.rs.temperature == 0).all())
        nf = not greedy and bool(((new.rs.top_k > 0) | (new.rs.top_p < 1)).any())
        tok = lpc = None
        for c in chunks:  # the last chunk's tokens (and log-probabilities) are the prompts' first
            prog = target_prefill_program(self.model.cfg, c.whole, self.window(c.window), greedy, nf)
            tok, lpc, self.tcache, self.rows = prog(
                self.model.params, self.tcache, self.rows, *chunk_args(c, self.put), new_d
            )
        self._first_lp = lpc if bool(np.asarray(new.rs.want_logprobs).any()) else None
        return tok

    def first_logprobs(self):
        """The admitted rows' first-token log-probabilities (None when none asked)."""
        from ssd_jax.errors import UserError
        from ssd_jax.sampling.logprobs import host_logprobs

        if self._first_lp is None:
            return None
        if not self._first_lp.is_fully_addressable:
            raise UserError("logprobs need the target's devices in this process (not with --launch)")
        return host_logprobs(np.asarray(self._first_lp), 0, 1)

    def admit(self, chunks, new: Rows):
        """Prefill the admitted rows; returns their first tokens (R,) and log-probabilities (or None)."""
        return np.asarray(self.admit_target(chunks, new)), self.first_logprobs()

    def admitted(self, slots, prompts, first) -> None:
        """After :meth:`admit`: the admitted slots, their whole prompts (what their cache rows hold) and
        first tokens, for state kept on the host."""

    def queues_ahead(self) -> bool:
        """Whether the engine may queue the next round before reading this one (two rounds in flight)."""
        return True

    def drain(self, handle) -> None:
        """Wait for a round dispatched past the end (its outcome is not read)."""
        jax.block_until_ready(handle)

    def metrics(self, wall: float, ttft: float, rounds: int) -> dict:
        """The method's metrics of an offline run (``wall``, ``ttft`` in seconds; ``rounds`` dispatched)."""
        return {}


class AR(Method):
    """Plain autoregressive decoding: one step per token for every slot."""

    name = "ar"
    bucketed = True
    pageable = True

    def compile_rounds(self, windows) -> None:
        for mode in self.modes:
            for w in windows:
                for b in self.buckets:
                    prog = runtime.ar_round_program(
                        self.model.cfg, mode.needs_filter, self.window(w), mode.greedy, self.bucket(b)
                    )
                    off = self.active(np.zeros(self.B, bool))
                    prog.precompile(self.model.params, self.tcache, self.round_rows(mode), off)

    def dispatch(self, live, window, mode, bucket=None):
        prog = runtime.ar_round_program(
            self.model.cfg, mode.needs_filter, self.window(window), mode.greedy, self.bucket(bucket)
        )
        out, tok, self.tcache, steps = prog(
            self.model.params, self.tcache, self.round_rows(mode), self.active(live)
        )
        self.rows = dataclasses.replace(self.rows, cur=tok, steps=steps)
        return out

    def read(self, out, live, fresh) -> RoundOut:
        from ssd_jax.sampling.logprobs import host_logprobs

        t = np.asarray(out)
        one = np.ones(self.B, np.int64)
        return RoundOut(t[:, :1], one, np.zeros(self.B, np.int64), logprobs=host_logprobs(t, 1, 1))


class ARRounds(AR):
    """SD or SSD whose plan runs AR rounds (K auto, no configuration predicted to beat AR by more than the
    planner's error: :mod:`ssd_jax.planning.configure`) where the method's K is fixed (an EAGLE-style head,
    SD on two meshes or stage by stage): the target's AR rounds, no draft, reported under the method's
    name as rounds of K = 0 (nothing proposed: acceptance 0.0 of 0 proposals, 1.0 tokens a round)."""

    speculates = True

    def __init__(self, model, modes, spec):
        super().__init__(model, modes)
        self.name, self.spec = spec.method, spec

    def metrics(self, wall: float, ttft: float, rounds: int) -> dict:
        d = self.spec.draft
        out = {
            "k": int(self.spec.k),
            "draft": d if d is None or isinstance(d, str) else d.name,  # a name, or a LoadedModel
            "draft_s": None, "verify_s": None, "sample_s": None, "overhead_s": None,
            "calls_per_round": 1,
            "rounds_without_proposals": rounds,
            "k_adaptive": False,
            "k_rounds": {"0": rounds},
        }  # fmt: skip
        if self.name == "ssd":  # no speculation, no lookups
            out.update(cache_hit_rate=0.0, batch_cache_hit_rate=0.0, tau_hit=0.0, tau_miss=0.0)
            out["fallback_calls"] = {"neural": 0, "ngram": 0, "random": 0}
        return out
