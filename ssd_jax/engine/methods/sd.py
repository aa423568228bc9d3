"""SD in the engine: one compiled round per step on one device (draft model, n-gram or random
proposals; K fixed or re-chosen every round), the stage-by-stage round of ``--profile-stages``, and the
draft model on a mesh (or process) of its own."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from ssd_jax.planning.policy import OnlineK
from ssd_jax.compile import Compiled
from ssd_jax.decoding.sd import host_width, sd_round_program, sd_steps
from ssd_jax.decoding.sd_two_mesh import sd_two_mesh_programs
from ssd_jax.decoding.slots import Rows, draft_prefill_program
from ssd_jax.drafters.model import draft_steps as draft_programs
from ssd_jax.drafters.ngram import ngram_proposals
from ssd_jax.engine.core import RoundOut
from ssd_jax.engine.methods.lag_book import LagBook
from ssd_jax.engine.methods.base import Method, chunk_args
from ssd_jax.parallel.placement import cache_for
from ssd_jax.sampling.filters import fold_in
from ssd_jax.sampling.logprobs import host_logprobs


@dataclasses.dataclass(frozen=True)
class SDRound:
    """A dispatched SD round: its device output, K, the host's proposal counts (n-gram) and live rows."""

    out: jax.Array  # (B, W+2+P): W + 1 emitted tokens, the accepted count, log-probability columns
    k: int
    n_draft: np.ndarray | None
    live: np.ndarray
    w: int  # proposal columns verified (k, or 0 for an n-gram round without proposals)

    def split(self, host: np.ndarray):
        """(emitted (B, W+1), accepted (B,), log-probabilities or None) from the host array."""
        w = self.w + 1
        return host[:, :w], host[:, w], host_logprobs(host, w + 1, w)


class SD(Method):
    """SD on one device: ``kind`` is "model", "random" or "host" (n-gram proposals)."""

    name = "sd"
    speculates = True
    bucketed = True
    pageable = True

    def __init__(self, model, modes, spec, drafter):
        super().__init__(model, modes)
        self.spec, self.drafter = spec, drafter
        self.kind = {"model": "model", "random": "random"}.get(drafter.kind, "host")
        self.draft = drafter.model if self.kind == "model" else None
        self.K = int(spec.k)
        plan = spec.k_plan if self.kind != "random" else None
        self.sched = OnlineK(plan) if plan is not None else None
        # the Ks the plan can pick at some acceptance (programs for the others would never run); K = 0 is
        # an AR round (for a draft model: with the draft idle, ``ssd_jax.decoding.sd_lag``)
        self.plan = plan
        ks = {self.K}
        if plan is not None:  # the exploring rounds' Ks too (policy.EXPLORE_EVERY)
            ks |= plan.ks_at(None)
        self.widths = sorted(ks | ({0} if self.kind == "host" else set()))
        self.lags = self.kind == "model" and 0 in self.widths
        self.k_max = max(self.widths)
        self.extra_slots = self.k_max + 1
        self.empty_rounds = 0

    def setup_draft(self, engine) -> None:
        self.dcache = (
            cache_for(self.draft, self.B, self.max_len, self.paged) if self.draft is not None else None
        )
        self.context = self.spec.draft_context if self.draft is not None else None
        if self.context is not None:  # each row's first visible slot (set by its first prefilled chunk)
            self.dcache = dataclasses.replace(self.dcache, start=self.put(np.zeros(self.B, np.int32)))
        self.catch = self.put(np.bool_(False))
        self._zeros: dict[int, tuple] = {}  # proposal width -> the device zeros a non-host round passes
        self._progs: dict = {}
        self._full = {k: np.full(self.B, k, np.int32) for k in self.widths}
        self.history = [np.zeros(0, np.int32)] * self.B
        if self.lags:  # what an idle draft has not seen (its first K = 0 round records prev too)
            self.lagbook = LagBook(self.B, self.put, first_extra=1)

    def _program(self, w: int, mode, window, bucket=None):
        key = (w, mode, window, bucket)
        prog = self._progs.get(key)  # a dict lookup per round, not a hash of both model configs
        if prog is None:
            prog = self._progs[key] = self._build_program(w, mode, window, bucket)
        return prog

    def _build_program(self, w: int, mode, window, bucket):
        dcfg = self.draft.cfg if self.draft is not None else None
        rand_vocab = self.drafter.vocab if self.kind == "random" else self.model.cfg.vocab_size
        nf = mode.needs_filter and not mode.greedy
        return sd_round_program(
            self.model.cfg, dcfg, w, self.model.cfg.vocab_size, rand_vocab, nf, self.kind, mode.greedy,
            self.window(window), self.bucket(bucket),
        )  # fmt: skip

    def _round_args(self, live, host_toks, host_n, mode):
        """The round's arguments; host proposals uploaded (n-gram), else zeros kept on the device."""
        dparams = self.draft.params if self.draft is not None else None
        if self.kind == "host":
            toks, n = self.put(host_toks), self.put(host_n)
        else:
            w = host_toks.shape[1]
            if w not in self._zeros:
                self._zeros[w] = (self.put(host_toks), self.put(host_n))
            toks, n = self._zeros[w]
        return (self.model.params, self.tcache, dparams, self.dcache, self.round_rows(mode), self.catch,
                self.active(live), toks, n)  # fmt: skip

    def widths_at(self, bucket: int) -> list[int]:
        """The Ks a round of ``bucket`` rows may run: those its plan picks at some acceptance (with one
        plan: every bucket's; n-gram: 0 too, a round without proposals)."""
        if self.plan is None:
            return self.widths
        return sorted(self.plan.ks_at(bucket) | ({0} if self.kind == "host" else set()))

    def compile_rounds(self, windows) -> None:
        """Every round program a bucket may run (a server compiles them all at start-up: one per mode,
        window, bucket and K the bucket's plan can choose; XLA:CPU maps each executable's code separately,
        and the kernel's limit on a process's memory maps, 65,530 by default, bounds how many fit)."""
        off = np.zeros(self.B, bool)
        for b in self.buckets:
            ks = self.widths_at(b)
            for mode in self.modes:
                for w in windows:
                    for k in ks:
                        if k == 0 and self.lags:
                            lb = self.lagbook
                            args = lb.ar_args(
                                self.model, self.tcache, self.round_rows(mode), self.catch, self.active(off)
                            )
                            lb.ar_program(self.model.cfg, mode, self.window(w), self.bucket(b)).precompile(
                                *args
                            )
                            continue
                        z = (np.zeros((self.B, k), np.int32), np.zeros(self.B, np.int32))
                        self._program(k, mode, w, b).precompile(*self._round_args(off, *z, mode))
            if self.lags and any(k > 0 for k in ks):  # the draft is caught up before a K > 0 round
                lb = self.lagbook
                lb.flush_program(self.draft.cfg, self.bucket(b)).precompile(
                    *lb.flush_args(self.draft, self.dcache)
                )
        if self.lags:
            self.lagbook.precompile(self.B)

    def _flush(self, bucket) -> None:
        self.dcache = self.lagbook.flush(self.draft, self.dcache, self.bucket(bucket))

    def _lag_round(self, live, window, mode, bucket) -> SDRound:
        """A K = 0 round: an AR step, the draft idle (its missed tokens recorded)."""
        if self.lagbook.full():  # catch the draft up first
            self._flush(bucket)
        out, self.tcache, (cur, prev, steps), self.catch = self.lagbook.ar_round(
            self.model, self.tcache, self.round_rows(mode), self.catch, self.active(live), mode,
            self.window(window), self.bucket(bucket),
        )  # fmt: skip
        self.rows = dataclasses.replace(self.rows, cur=cur, prev=prev, steps=steps)
        return SDRound(out, 0, None, live, 0)

    def compile_admission(self, chunks) -> None:
        """The target's prefill (:meth:`Method.compile_admission`) and the draft model's, whose first
        chunk differs where the draft sees a window of the prompt."""
        super().compile_admission(chunks)
        if self.draft is None:
            return
        for c in chunks:
            for opening in {False, self.context is not None}:
                prog = draft_prefill_program(self.draft.cfg, c.whole, self.window(c.window), opening)
                prog.precompile(self.draft.params, self.dcache, *chunk_args(c, self.put))

    def admit(self, chunks, new: Rows):
        first = np.asarray(self.admit_target(chunks, new))
        if self.draft is not None:
            opening = True
            for c in self._draft_chunks(chunks):
                prog = draft_prefill_program(
                    self.draft.cfg, c.whole, self.window(c.window), opening and self.context is not None
                )
                opening = False
                self.dcache = prog(
                    self.draft.params, self.dcache, self.put(c.tokens), self.put(c.n_valid), self.put(c.slots),
                    self.put(c.starts),
                )  # fmt: skip
            if self.lags:
                admitted = np.zeros(self.B, bool)
                admitted[chunks[0].slots] = True
                self.lagbook.admitted(admitted)
            jax.block_until_ready(self.dcache)
        return first, self.first_logprobs()

    def _draft_chunks(self, chunks):
        """The prefill chunks the draft runs: all of them, or with a context window W those from the first
        that holds one of a row's last W prompt tokens (the chunk that holds a row's last token always
        runs, so every row's window starts at that first chunk)."""
        if self.context is None:
            return chunks
        ends = [c.starts + c.n_valid for c in chunks]
        lens = np.max(np.where([c.n_valid > 0 for c in chunks], ends, 0), axis=0)
        need = [bool(((c.n_valid > 0) & (e > lens - self.context)).any()) for c, e in zip(chunks, ends)]
        return chunks[need.index(True) :]

    def admitted(self, slots, prompts, first) -> None:
        if self.kind == "host":  # the n-gram lookup's history: the whole prompt (a cached prefix included)
            for b, p, t in zip(slots, prompts, first):
                self.history[b] = np.asarray(list(p) + [int(t)], np.int32)

    def queues_ahead(self) -> bool:
        return self.kind != "host"  # n-gram lookups need the round's tokens

    def ngram(self, live, k: int):
        """The live rows' n-gram proposals (tokens, counts) and the columns the round verifies: k, or 0
        when no live row has one (that round is one target step)."""
        toks, n_h = ngram_proposals(
            self.history,
            k,
            self.spec.prompt_lookup_min,
            self.spec.prompt_lookup_max,
            rows=np.flatnonzero(live),
        )
        w = host_width(n_h, live, k)
        self.empty_rounds += w == 0
        return toks, n_h, w

    def set_pages(self, table) -> None:
        super().set_pages(table)
        if self.dcache is not None:  # the draft's pool has the same blocks: the same table
            self.dcache = dataclasses.replace(self.dcache, pages=self.put(table))

    def restore(self, b: int, state, cur: int) -> None:
        super().restore(b, state, cur)
        if self.kind == "host":  # its history ends with the token the re-admission sampled: cur instead
            self.history[b] = np.concatenate([self.history[b][:-1], np.array([cur], np.int32)])

    def next_k(self, bucket=None, explore=True) -> int:
        return self.sched.k_for(bucket, explore) if self.sched is not None else self.K

    def dispatch(self, live, window, mode, bucket=None) -> SDRound:
        # exploring rounds only where every live row is greedy (its output does not depend on K), so a
        # seeded sampled request's K schedule is the plan's, not the server's history
        k = self.next_k(bucket, explore=mode.greedy)
        if self.lags:
            if k == 0:
                return self._lag_round(live, window, mode, bucket)
            if self.lagbook.rounds:
                self._flush(bucket)
        if self.kind == "host":
            toks, n_h, w = self.ngram(live, k)
        else:
            w, toks, n_h = k, np.zeros((self.B, k), np.int32), None
        hn = n_h if n_h is not None else np.zeros(self.B, np.int32)
        out, self.tcache, self.dcache, (cur, prev, steps), self.catch = self._program(
            w, mode, window, bucket
        )(*self._round_args(live, toks[:, :w], hn, mode))
        self.rows = dataclasses.replace(self.rows, cur=cur, prev=prev, steps=steps)
        return SDRound(out, k, n_h, live, w)

    def read(self, rnd: SDRound, live, fresh) -> RoundOut:
        emitted, n_acc, lps = rnd.split(np.asarray(rnd.out))
        n_draft = rnd.n_draft if rnd.n_draft is not None else self._full[rnd.k]
        if self.sched is not None:
            self.sched.update(rnd.k, live, n_acc, n_draft)
        if self.kind == "host":
            for b in np.flatnonzero(live):
                self.history[b] = np.concatenate([self.history[b], emitted[b, : n_acc[b] + 1]])
        return RoundOut(emitted, n_acc + 1, n_draft, logprobs=lps, k=rnd.k)

    def drain(self, rnd: SDRound) -> None:
        jax.block_until_ready(rnd.out)

    def metrics(self, wall: float, ttft: float, rounds: int) -> dict:
        return {
            "k": self.K,
            "draft": self.drafter.kind if self.kind != "model" else self.draft.name,
            "draft_s": None, "verify_s": None, "sample_s": None, "overhead_s": None,
            "calls_per_round": 1,
            "rounds_without_proposals": self.empty_rounds,
            **(self.sched.metrics() if self.sched is not None else {}),
            "k_adaptive": self.sched is not None,
        }  # fmt: skip


def clock() -> float:
    """Seconds, less the time spent compiling so far (a stage that compiles on first use is timed
    without its compile, which is reported as compile_s)."""
    return time.perf_counter() - Compiled.total_s


class SDProfiled(SD):
    """``--profile-stages``: each round as timed draft, verify and sample calls (the same keys, so the
    same tokens as the one-call round, slower). K stays fixed; every slot runs (no batch buckets)."""

    bucketed = False
    pageable = False

    def __init__(self, model, modes, spec, drafter):
        super().__init__(model, modes, dataclasses.replace(spec, k_plan=None), drafter)
        self.times = {"draft_s": 0.0, "verify_s": 0.0, "sample_s": 0.0}
        self.catch_h = False

    def compile_rounds(self, windows) -> None:
        pass  # compiled on first use; the compile time is reported, not timed

    def _propose(self, live, k, nf: bool):
        keys = self.rows.key_batch
        kd = fold_in(fold_in(keys, 1), self.rows.steps)
        if self.kind == "model":
            prog = draft_programs(self.draft.cfg, k, self.model.cfg.vocab_size, nf)[1][self.catch_h]
            toks, q, self.dcache = prog(
                self.draft.params, self.dcache, self.rows.prev, self.rows.cur, kd, self.rows.rs
            )
            return toks, np.full(self.B, k, np.int32), q
        if self.kind == "random":
            from ssd_jax.drafters.random import random_tokens

            return random_tokens(kd, self.B, k, self.drafter.vocab), np.full(self.B, k, np.int32), None
        toks, n_h, w = self.ngram(live, k)
        return self.put(toks[:, :w]), n_h, None

    def dispatch(self, live, window, mode, bucket=None) -> SDRound:
        from ssd_jax.decoding.slots import park

        k, rows = self.K, self.rows
        a = clock()
        toks, n_h, q = self._propose(live, k, mode.needs_filter)
        jax.block_until_ready(toks)
        b = clock()
        score, acc = sd_steps(self.model.cfg, mode.needs_filter)  # the filter only where a row needs it
        logits, self.tcache = score(self.model.params, self.tcache, rows.cur, toks)
        jax.block_until_ready(logits)
        c = clock()
        emitted, n_acc, lengths, _, prev, cur, lpc = acc(
            fold_in(rows.key_batch, 2), rows.steps, logits, toks, self.put(n_h), q, rows.rs, self.tcache.lengths,
            rows.cur,
        )  # fmt: skip
        n_acc_h = np.asarray(n_acc)
        d = clock()
        for name, dt in (("draft_s", b - a), ("verify_s", c - b), ("sample_s", d - c)):
            self.times[name] += dt
        active = self.active(live)
        self.tcache = park(self.tcache.with_lengths(lengths), active)
        if self.dcache is not None:
            self.dcache = park(self.dcache.with_lengths(lengths + 0), active)
        self.rows = dataclasses.replace(rows, cur=cur, prev=prev, steps=rows.steps + 1)
        self.catch_h = bool((n_acc_h >= n_h)[live].any())
        out = jax.numpy.concatenate([emitted, n_acc[:, None], lpc], axis=1)
        return SDRound(out, k, n_h if self.kind == "host" else None, live, toks.shape[1])

    def metrics(self, wall: float, ttft: float, rounds: int) -> dict:
        overhead = max(0.0, wall - ttft - sum(self.times.values()))
        return {
            **super().metrics(wall, ttft, rounds),
            **self.times,
            "overhead_s": overhead,
            "calls_per_round": 3,
        }


class SDTwoMeshes(Method):
    """SD with the draft model on a mesh of its own (possibly another process): per round one draft
    call and one target call, proposals crossing to the target and the outcome back; K fixed."""

    name = "sd"
    speculates = True

    def __init__(self, placement, modes, spec, drafter):
        super().__init__(placement.target, modes)
        self.pl, self.spec, self.drafter = placement, spec, drafter
        self.draft, self.K = placement.draft, int(spec.k)
        self.k_max, self.extra_slots = self.K, self.K + 1
        self.put = placement.put_target

    def setup_draft(self, engine) -> None:
        dput = self.pl.put_draft
        self.dcache = cache_for(self.draft, self.B, self.max_len)
        self.drows = jax.tree.map(dput, Rows.empty(self.B, self.n_ban))
        self.dlen, self.catch = dput(np.zeros(self.B, np.int32)), dput(np.bool_(False))

    def _programs(self, mode, window):
        nf = mode.needs_filter and not mode.greedy
        return sd_two_mesh_programs(
            self.model.cfg, self.draft.cfg, self.K, self.model.cfg.vocab_size, nf, self.window(window)
        )

    def compile_rounds(self, windows) -> None:
        """One round per mode and window over free slots (results ignored): the programs and the moves
        between processes are compiled before any timing."""
        off = np.zeros(self.B, bool)
        for mode in self.modes:
            for w in windows:
                self.read(self.dispatch(off, w, mode), off, off)

    def compile_admission(self, chunks) -> None:
        super().compile_admission(chunks)
        dput, one = self.pl.put_draft, np.zeros(1, np.int32)
        for whole in {c.whole for c in chunks}:
            c = next(c for c in chunks if c.whole == whole)
            prog = draft_prefill_program(self.draft.cfg, whole, None)
            prog.precompile(self.draft.params, self.dcache, *chunk_args(c, dput))
        new_d = dataclasses.replace(jax.tree.map(dput, Rows.empty(1, self.n_ban)), cur=dput(one))
        _, _, admit = self._programs(next(iter(self.modes)), self.max_len)
        admit.precompile(self.drows, self.dlen, dput(one), new_d, dput(one))

    def admit(self, chunks, new: Rows):
        dput = self.pl.put_draft
        tok = self.admit_target(chunks, new)
        for c in chunks:
            prog = draft_prefill_program(self.draft.cfg, c.whole, None)
            self.dcache = prog(
                self.draft.params, self.dcache, dput(c.tokens), dput(c.n_valid), dput(c.slots), dput(c.starts)
            )
        tok_d, tok_all = self.pl.to_draft(tok)
        lengths = np.where(chunks[-1].n_valid > 0, chunks[-1].starts + chunks[-1].n_valid, chunks[-1].starts)
        new_d = jax.tree.map(dput, new)
        new_d = dataclasses.replace(new_d, cur=tok_d)
        _, _, admit = self._programs(next(iter(self.modes)), self.max_len)
        self.drows, self.dlen = admit(
            self.drows, self.dlen, dput(chunks[0].slots), new_d, dput(lengths.astype(np.int32))
        )
        jax.block_until_ready(self.dcache)
        return self.pl.read(tok_all), self.first_logprobs()

    def dispatch(self, live, window, mode, bucket=None):
        draft_prog, target_prog, _ = self._programs(mode, window)
        toks, q, self.dcache, self.drows = draft_prog(
            self.draft.params, self.dcache, self.drows, self.dlen, self.catch
        )
        (toks_t, q_t), _ = self.pl.to_target((toks, q))
        out, self.tcache, self.rows, outcome = target_prog(
            self.model.params, self.tcache, self.rows, toks_t, q_t, self.active(live)
        )
        ((cur, prev, self.catch, self.dlen), _), (_, out_all) = self.pl.to_draft((outcome, out))
        self.drows = dataclasses.replace(self.drows, cur=cur, prev=prev)
        return out_all

    def read(self, out, live, fresh) -> RoundOut:
        emitted, n_acc, lps = SDRound(out, self.K, None, live, self.K).split(self.pl.read(out))
        return RoundOut(emitted, n_acc + 1, np.full(self.B, self.K, np.int32), logprobs=lps)

    def metrics(self, wall: float, ttft: float, rounds: int) -> dict:
        return {
            "k": self.K,
            "draft": self.draft.name,
            "draft_s": None, "verify_s": None, "sample_s": None, "overhead_s": None,
            "calls_per_round": 2,
            "rounds_without_proposals": 0,
            "devices": device_metrics(self.pl),
        }  # fmt: skip


def device_metrics(pl) -> dict:
    return {
        "single_device": pl.single,
        "target": len(pl.target_devices),
        "draft": len(pl.draft_devices),
        "processes": jax.process_count(),
        "target_processes": sorted({d.process_index for d in pl.target_devices}),
        "draft_processes": sorted({d.process_index for d in pl.draft_devices}),
    }
