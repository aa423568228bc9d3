"""SSD in the engine: one compiled round per step when both models share a device; on two meshes (or
two processes) one target call (verify + sampling) and two draft calls (the tree build, overlapping the
verify, and the lookup with its backup once the outcome has crossed back). ``--profile-stages`` /
``--trace`` run the stages as separate calls on a timeline. The backups: neural, random, n-gram (the
host reads the round's tokens before its lookup) and auto (neural below the critical batch size b*)."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from ssd_jax.decoding.slots import Rows, draft_prefill_program
from ssd_jax.decoding.ssd import host as ssd_host
from ssd_jax.decoding.ssd.host import SpecMeta, SSDStats
from ssd_jax.decoding.ssd.paging import draft_pages, put_row, take_row
from ssd_jax.planning.policy import BucketSwitch
from ssd_jax.decoding.ssd.rounds import META, ssd_programs
from ssd_jax.decoding.ssd.tree import Opts
from ssd_jax.drafters.base import Proposal
from ssd_jax.drafters.ngram import ngram_proposals
from ssd_jax.engine.core import RoundOut
from ssd_jax.engine.methods.base import Method, chunk_args
from ssd_jax.engine.methods.backup_choice import BackupChoice
from ssd_jax.engine.methods.fanout_tables import FanoutTables
from ssd_jax.engine.methods.ar_switch import ARSwitch
from ssd_jax.engine.methods.stage_log import StageLog
from ssd_jax.engine.methods.ssd_rounds import Lookup, SSDRound
from ssd_jax.engine.methods.sd import device_metrics
from ssd_jax.errors import UserError
from ssd_jax.models import llama
from ssd_jax.sampling.logprobs import host_logprobs


class SSD(Method):
    name = "ssd"
    speculates = True

    def __init__(self, placement, modes, spec, *, trace_path=None):
        super().__init__(placement.target, modes)
        self.pl, self.spec, self.draft = placement, spec, placement.draft
        self.put, self.dput = placement.put_target, placement.put_draft
        self.K = K = int(spec.k)
        n_dd = 1 if placement.single else len(placement.draft_devices)
        self.fanout = FanoutTables(spec, n_dd)
        self.M = self.fanout.M
        if self.M % len(placement.draft_devices) and not placement.single:
            raise UserError(
                f"the fan-out budget ({self.M} branches) must divide over the {len(placement.draft_devices)} draft devices"
            )
        self.k_max, self.extra_slots = K, K + 1
        self.profiled = bool(trace_path) or spec.profile_stages
        self.stages = StageLog(placement, self.profiled, trace_path)
        self.fused = placement.single and not self.profiled
        # paged caches on one device per model (ssd_jax.decoding.ssd.paging)
        self.pageable = len(placement.target_devices) == 1 and len(placement.draft_devices) == 1
        # batch buckets: a round (fused on one device, or split over two meshes or processes) runs the
        # smallest bucket holding the running rows; the profiled stages run every slot
        self.bucketed = not self.profiled
        self.backup = BackupChoice(spec.backup, placement.single, K)
        self.carry_q = any(not m.greedy for m in self.modes)  # sampling rows: speculations carry q
        self.calls = 0
        # K auto in a server: AR rounds (K = 0) at the buckets where SSD's round cannot pay
        plan = spec.k_plan if isinstance(spec.k_plan, BucketSwitch) and not self.profiled else None
        self.switch = ARSwitch(plan, K, self.ar_buckets, self.bucket_costs)

    # --- set-up

    def setup_draft(self, engine) -> None:
        B, K, M, pl = self.B, self.K, self.M, self.pl
        tok = self.model.tokenizer
        # paged: the draft's pool is the target's blocks plus each slot's tree blocks (ssd.paging)
        self.dpages = None if self.paged is None else draft_pages(self.paged, B, self.max_len, M * K)
        self.opts = Opts(
            k=K, budget=M, vocab=self.model.cfg.vocab_size,
            rand_vocab=tok.vocab_size if tok is not None else self.model.cfg.vocab_size,
            needs_filter=False, greedy=not self.carry_q, c=float(self.spec.saguaro_c),
            tree_base=self.max_len if self.dpages is None else self.dpages.tree_base,
            mesh=None if pl.single else self.draft.mesh,
        )  # fmt: skip
        self.fanout.bind(B, self.dput)
        dcache = (
            llama.init_cache(self.draft.cfg, B, self.max_len + M * K)
            if self.dpages is None
            else self.dpages.cache(self.draft.cfg)
        )
        self.dcache = jax.tree.map(self.dput, dcache)
        self.drows = self.rows if self.fused else jax.tree.map(self.dput, Rows.empty(B, self.n_ban))
        q = None if not self.carry_q else np.full((B, K, self.model.cfg.vocab_size), -np.inf, np.float32)
        sp = Proposal(np.zeros((B, K), np.int32), np.full(B, K, np.int32), q, np.zeros(B, bool))
        self.sp, self.pm = jax.tree.map(self.dput, sp), self.dput(np.zeros(B, bool))
        self.sp_t = None if self.fused else ssd_host.spec_to_target(self.sp, pl)
        self._no_host = (self.dput(np.zeros((B, K), np.int32)), self.dput(np.zeros(B, np.int32)))
        self._open = None
        self.spec_meta = SpecMeta.empty(B)  # the speculation each row's next round verifies
        self.history = [np.zeros(0, np.int32)] * B
        self.stats = SSDStats(B)
        self.backup.price(
            self.model.cfg, self.draft.cfg, batch=B, k=K, budget=M, draft_devices=len(pl.draft_devices),
            context=0.75 * self.max_len, device=pl.draft_devices[0],
        )  # fmt: skip
        self.switch.bind(B, self.put)  # the tokens an idle draft misses in AR rounds, per row
        self.prom = engine.metrics  # the server's Prometheus metrics, if any

    def compile_rounds(self, windows) -> None:
        """Run one round of every kind, mode and window over free slots (results ignored), so the rounds'
        programs, the tree's shardings and the moves between processes are compiled before any timing;
        then forget what those rounds recorded."""
        off = np.zeros(self.B, bool)
        if self.switch.everywhere(self.buckets):  # AR rounds at every bucket: only they compile
            self.ar_buckets.update(self.buckets)
            for mode, w, b in ((m, w, b) for m in self.modes for w in windows for b in self.buckets):
                self.read(self._round("ar", off, w, mode, b), off, off)
            self.switch.lagbook.caught_up()
        else:
            self._compile_ssd_rounds(windows, off)
        self.calls, self.spec_meta = 0, SpecMeta.empty(self.B)
        self.switch.restart()
        self.stats = SSDStats(self.B)
        self.stages.restart()

    def _compile_ssd_rounds(self, windows, off) -> None:
        for mode in self.modes:
            for w in windows:
                for kind in self.backup.kinds:
                    for b in self.buckets:
                        self.read(self._round(kind, off, w, mode, b), off, off)
                        if self.switch.on:  # its AR round and its return to speculation
                            self.read(self._round("ar", off, w, mode, b), off, off)
                            self._catch_up(mode, b)
        if self.switch.on:
            self.switch.lagbook.precompile(self.B)
            self._choose_buckets(windows)

    def _choose_buckets(self, windows, repeats: int = 5) -> None:
        """Time the compiled SSD round and AR round at each bucket (the median of ``repeats`` over free
        slots, the widest window, the first mode) for the AR switch's choice."""
        off, mode, w = np.zeros(self.B, bool), self.modes[0], max(windows)

        def timed(ar: bool, b: int) -> float:
            ts = []
            for _ in range(repeats):
                a = time.perf_counter()
                self.drain(self._round("ar" if ar else self.backup.choose(off), off, w, mode, b))
                ts.append(time.perf_counter() - a)
            return float(np.median(ts))

        self.switch.choose(self.buckets, timed)
        self._catch_up(mode, self.buckets[-1])

    def bucket_note(self) -> str:
        return self.switch.note(self.buckets)

    @property
    def k_rounds(self) -> dict[int, int]:
        return self.switch.rounds

    def _catch_up(self, mode, bucket) -> None:
        """Back from AR rounds: the draft's cache caught up and a new speculation for the rows that lag
        (on two meshes what the target ran without the draft, its tokens and rows' state, crosses first)."""
        prog = self._progs(mode, bucket=bucket, admission=True)["catch_up"]
        lb = self.switch.lagbook
        rows, lag, lag_n = self.rows, lb.lag, lb.n
        if not self.fused:
            (lag, lag_n, cur, prev, steps), _ = self.pl.to_draft(
                (lag, lag_n, rows.cur, rows.prev, rows.steps)
            )
            rows = self.drows = dataclasses.replace(self.drows, cur=cur, prev=prev, steps=steps)
        self.sp, self.pm, self.dcache, lag_n = prog(
            self.draft.params, self.dcache, rows, self.sp, self.pm, lag, lag_n, self.fanout.ctrl(np.ones(self.B, bool)),
        )  # fmt: skip
        if self.fused:
            lb.caught_up(lag_n)
            self.drows = self.rows
        else:  # (the target's copy of the counts: every row level again)
            lb.admitted(np.ones(self.B, bool))
            lb.caught_up()
            self.sp_t = ssd_host.spec_to_target(self.sp, self.pl)

    def _ar_round(self, live, window, mode, bucket) -> SSDRound:
        lb = self.switch.lagbook
        if lb.full():  # catch the draft up first
            if self.idle:  # (no draft to catch up: the counts run past the buffer, which records no more)
                lb.caught_up()
            else:
                self._catch_up(mode, bucket)
        out, self.tcache, (cur, prev, steps), _ = lb.ar_round(
            self.model, self.tcache, self.round_rows(mode), self.switch.no_catch, self.active(live), mode,
            self.window(window), self.bucket(bucket),
        )  # fmt: skip
        self.rows = dataclasses.replace(self.rows, cur=cur, prev=prev, steps=steps)
        if self.fused:
            self.drows = self.rows
        else:  # a copy every process reads (the draft's is caught up before SSD's next round)
            out = self.pl.to_draft(out)[1]
        return SSDRound("ar", self.fanout.sched, out)

    def _progs(self, mode, window=None, bucket=None, admission=False):
        # a round whose rows are all greedy builds its tree without the draft's distributions q (the
        # verifier compares tokens only), keeping the speculations' q as they were; admission computes q
        # whenever a row may sample (its first speculation is verified by the next round, of any mode)
        greedy = not self.carry_q or (mode.greedy and not admission)
        opts = dataclasses.replace(self.opts, needs_filter=self.carry_q and mode.needs_filter, greedy=greedy)
        return ssd_programs(
            self.model.cfg,
            self.draft.cfg,
            opts,
            self.fanout.ctl,
            self.window(window or self.max_len),
            self.bucket(bucket),
        )

    # --- the paged cache

    @property
    def page_reach(self) -> int:
        # the verify and the tree build's re-run write K + 1 slots from the row's length L; a backup
        # re-draft writes K more from the new length (at most L + K + 1), up to slot L + 2K
        return max(self.K + 2, 2 * self.K)

    def set_pages(self, table) -> None:
        super().set_pages(table)
        self.dcache = dataclasses.replace(self.dcache, pages=self.dput(self.dpages.table(table)))

    def _row_parts(self):
        """What a preempted row keeps: its (cur, prev, step) on the target's mesh; on the draft's its
        speculation, post-miss flag and (split rounds) the draft's copy of the row's state."""
        r, d = self.rows, self.drows
        on_draft = (self.sp, self.pm) + (() if self.fused else ((d.cur, d.prev, d.steps),))
        return (r.cur, r.prev, r.steps), on_draft

    def row_state(self, b: int):
        on_target, on_draft = self._row_parts()
        return take_row(on_target, self.put(np.int32(b))), take_row(on_draft, self.dput(np.int32(b)))

    def restore(self, b: int, state, cur: int) -> None:
        """A re-admitted row verifies the speculation it had when preempted, from its own (cur, prev,
        step) (:mod:`ssd_jax.decoding.ssd.paging`)."""
        on_target, on_draft = self._row_parts()
        (c, p, st), d = (
            put_row(on_target, state[0], self.put(np.int32(b))),
            put_row(on_draft, state[1], self.dput(np.int32(b))),
        )
        self.rows = dataclasses.replace(self.rows, cur=c, prev=p, steps=st)
        self.sp, self.pm = d[0], d[1]
        if self.fused:
            self.drows = self.rows
        else:
            self.drows = dataclasses.replace(self.drows, cur=d[2][0], prev=d[2][1], steps=d[2][2])
            self.sp_t = ssd_host.spec_to_target(self.sp, self.pl)
        if self.backup.uses_host:  # its history ends with the token the re-admission sampled: cur instead
            self.history[b] = np.concatenate([self.history[b][:-1], np.array([cur], np.int32)])

    # --- admission

    @property
    def idle(self) -> bool:
        """Every bucket runs AR rounds: the draft is never used (admission skips it)."""
        return self.switch.idle(self.buckets)

    def compile_admission(self, chunks) -> None:
        """The target's prefill (:meth:`Method.compile_admission`), the draft's, and the admitted row's
        first speculation (none where every bucket runs AR rounds)."""
        super().compile_admission(chunks)
        if self.idle:
            return
        dput, one = self.dput, np.zeros(1, np.int32)
        for c in {c.whole: c for c in chunks}.values():
            prog = draft_prefill_program(self.draft.cfg, c.whole, None)
            prog.precompile(self.draft.params, self.dcache, *chunk_args(c, dput))
        new_d = dataclasses.replace(jax.tree.map(dput, Rows.empty(1, self.n_ban)), cur=dput(one))
        first = self._progs(self.modes[0], admission=True)[f"first_{self.backup.first}_{chunks[0].whole}"]
        first.precompile(
            self.draft.params, self.dcache, self.drows, self.sp, self.pm, dput(one), new_d,
            self.fanout.ctrl(np.zeros(self.B, bool)),
        )  # fmt: skip

    def admit(self, chunks, new: Rows):
        pl, dput = self.pl, self.dput
        self._finish_open()  # the round in flight looks its outcome up before new rows' speculations land
        tok = self.admit_target(chunks, new)
        if self.idle:  # the target alone; the first tokens read where every process can (across processes)
            return pl.read(tok if pl.single else pl.to_draft(tok)[1]), self.first_logprobs()
        if self.fused:
            self.drows = self.rows
        for c in chunks:
            prog = draft_prefill_program(self.draft.cfg, c.whole, None)
            self.dcache = prog(
                self.draft.params, self.dcache, dput(c.tokens), dput(c.n_valid), dput(c.slots), dput(c.starts)
            )
        tok_d, tok_all = (tok, tok) if pl.single else pl.to_draft(tok)
        new_d = dataclasses.replace(jax.tree.map(dput, new), cur=tok_d)
        slots = chunks[0].slots
        first = self._progs(next(iter(self.modes)), admission=True)[
            f"first_{self.backup.first}_{chunks[0].whole}"
        ]
        live = np.zeros(self.B, bool)
        live[slots] = True
        self.sp, self.pm, self.dcache, self.drows = first(
            self.draft.params,
            self.dcache,
            self.drows,
            self.sp,
            self.pm,
            dput(slots),
            new_d,
            self.fanout.ctrl(live),
        )
        self.stages.record(f"fallback_{self.backup.first}", "draft", self.sp.tokens, round=0)
        self.stats.fallback_calls[self.backup.first] += 1
        if self.fused:
            self.rows = self.drows
        else:
            self.sp_t = ssd_host.spec_to_target(self.sp, pl)
        if self.switch.on:  # admitted rows start level with the target (their prompt prefilled)
            self.switch.lagbook.admitted(live)
        self.spec_meta.drafted(slots, self.K, post_miss=self.backup.first != "neural")
        first_h = pl.read(tok_all)
        if self.backup.uses_host:
            for r, b in enumerate(slots.tolist()):
                toks = [t for c in chunks for t in c.tokens[r, : c.n_valid[r]].tolist()]
                self.history[b] = np.asarray(toks + [int(first_h[r])], np.int32)
        jax.block_until_ready(self.sp.tokens)
        return first_h, self.first_logprobs()

    # --- rounds

    _open: SSDRound | None = None  # the split round whose lookup is still to run (see :class:`Lookup`)

    def queues_ahead(self) -> bool:
        return self.backup.next != "host"

    def dispatch(self, live, window, mode, bucket=None) -> SSDRound:
        ar = self.switch.runs_ar(bucket)
        return self._round("ar" if ar else self.backup.choose(live), live, window, mode, bucket)

    def _round(self, kind: str, live, window, mode, bucket) -> SSDRound:
        """A round of ``kind``: "ar" (the target alone) or SSD's with that lookup backup. :meth:`dispatch`
        runs the bucket's and the backup choice's; the warm-up and the per-bucket timing name theirs."""
        self._finish_open()
        if kind == "ar":
            return self._ar_round(live, window, mode, bucket)
        if self.switch.lagging():
            self._catch_up(mode, bucket)
        self.backup.next = kind
        ctrl = self.fanout.ctrl(live)
        rnd = SSDRound(kind, self.fanout.sched, None)
        active = self.active(live)
        if self.fused and kind != "host":
            rnd.out, self.sp, self.pm, self.tcache, self.dcache, self.rows = self._progs(
                mode, window, bucket
            )[f"round_{kind}"](
                self.model.params,
                self.tcache,
                self.draft.params,
                self.dcache,
                self.rows,
                self.sp,
                self.pm,
                active,
                ctrl,
            )
            self.drows = self.rows
            self.calls += 1
            return rnd
        return self._dispatch_split(rnd, self._progs(mode, window, bucket), ctrl, live, active)

    def _dispatch_split(self, rnd, progs, ctrl, live, active) -> SSDRound:
        pl, tl, step = self.pl, self.stages, self.calls + 1
        active_d = active if pl.single else self.dput(live)
        if self.fused:  # an n-gram round of a one-device run: the speculation is already in place
            self.sp_t = ssd_host.spec_only(self.sp)
        if self.profiled:
            logits, self.tcache = progs["score"](
                self.model.params, self.tcache, self.rows.cur, self.sp_t.tokens
            )
            tl.record("verify", "target", logits, round=step)
        else:
            out, outcome, self.tcache, self.rows = progs["verify"](
                self.model.params, self.tcache, self.rows, self.sp_t, active
            )
            tl.record("verify", "target", out, round=step)
        tree, self.dcache = progs["build"](self.draft.params, self.dcache, self.drows, self.sp, self.pm, ctrl)
        tl.record("build", "draft", tree.tokens, round=step)
        if self.profiled:
            out, outcome, self.tcache, self.rows = progs["sample"](
                logits, self.tcache, self.rows, self.sp_t, active
            )
            tl.record("sample", "target", outcome, round=step)
        rnd.out = out
        rnd.lookup = Lookup(progs, ctrl, live, active_d, tree, outcome, step)
        self._open = rnd
        self.calls += 3 + self.profiled
        return rnd

    def _finish_open(self) -> None:
        if self._open is not None:
            self._finish(self._open)

    def _finish(self, rnd: SSDRound) -> None:
        """A split round's second half (:class:`Lookup`): the outcome to the draft, the lookup and backup
        there, the next speculation and its meta back to the target."""
        pl, tl, lk = self.pl, self.stages, rnd.lookup
        rnd.lookup, self._open = None, None
        outcome, progs, step = lk.outcome, lk.progs, lk.step
        if not pl.single:
            (outcome, _), (_, rnd.out) = pl.to_draft((outcome, rnd.out))
        host_tok, host_n = self._no_host
        if rnd.kind == "host":  # n-gram lookups need this round's tokens: read them now
            rnd.host = pl.read(rnd.out)
            self._extend_history(rnd.host, lk.live)
            a = time.perf_counter()
            ng, ng_n = ngram_proposals(
                self.history,
                self.K,
                self.spec.prompt_lookup_min,
                self.spec.prompt_lookup_max,
                rows=np.flatnonzero(lk.live),
            )
            host_tok, host_n = self.dput(ng), self.dput(ng_n.astype(np.int32))
            tl.mark("ngram", round=step, start=a, end=time.perf_counter())
        # (a greedy round's speculations keep their q: advance_slot puts the new ones into sp)
        self.sp, self.pm, meta, self.dcache, self.drows = progs[f"advance_{rnd.kind}"](
            self.draft.params, lk.tree, self.dcache, outcome, self.drows, lk.ctrl, host_tok, host_n, lk.active_d,
            self.sp, self.pm,
        )  # fmt: skip
        tl.record("advance", "draft", self.sp.tokens, round=step)
        if pl.bridge is None:
            self.sp_t, rnd.meta = ssd_host.spec_to_target(self.sp, pl), meta
        else:
            (self.sp_t, _), (_, rnd.meta) = pl.to_target((ssd_host.spec_only(self.sp), meta))

    def _extend_history(self, host: np.ndarray, live) -> None:
        K = self.K
        for b in np.flatnonzero(live):
            self.history[b] = np.concatenate([self.history[b], host[b, : host[b, K + 1] + 1]])

    def read(self, rnd: SSDRound, live, fresh) -> RoundOut:
        K, pl = self.K, self.pl
        if rnd.kind == "ar":  # an AR round: one token per row; the rows' next speculation is drafted anew
            out_h = pl.read(rnd.out)
            self.k_rounds[0] += 1
            self.spec_meta.drafted(live & ~fresh, K)
            if self.backup.uses_host:  # the n-gram backup's history gets the round's token
                for b in np.flatnonzero(live):
                    self.history[b] = np.append(self.history[b], out_h[b, :1].astype(np.int32))
            n = np.zeros(self.B, np.int64)
            return RoundOut(out_h[:, :1], n + 1, n, n > 0, logprobs=host_logprobs(out_h, 2, 1), k=0)
        self.k_rounds[K] += 1
        if rnd.lookup is not None:  # not queued ahead: its lookup runs now
            self._finish(rnd)
        host_known = rnd.host is not None
        out_h = rnd.host if host_known else pl.read(rnd.out)
        n_acc = out_h[:, K + 1]
        fused = rnd.meta is None  # the next speculation's meta rides in the host array, before the log-probs
        nxt = SpecMeta.read(out_h[:, K + 2 : K + 2 + META] if fused else pl.read(rnd.meta))
        lps = host_logprobs(out_h, K + 2 + META * fused, K + 1)
        cur = self.spec_meta
        self._learn(rnd, live, n_acc, cur, nxt)
        self.spec_meta = cur.updated(nxt, keep=fresh)
        if self.backup.uses_host and not host_known:
            self._extend_history(out_h, live)
        self.fanout.refresh()
        return RoundOut(out_h[:, : K + 1], n_acc + 1, cur.n_draft, cur.hit, logprobs=lps, k=K)

    def _learn(self, rnd, lv, n_acc, cur: SpecMeta, nxt: SpecMeta) -> None:
        """The round's statistics (:class:`SSDStats`), the backup decision's means, the fan-out estimators."""
        self.backup.learn(lv, n_acc, cur, nxt, self.B)
        self.stats.count_round(lv, n_acc, cur, nxt, {"host": "ngram"}.get(rnd.kind, rnd.kind))
        if not lv.any():
            return
        self.fanout.observe(rnd.sched, n_acc[lv], cur.n_draft[lv], nxt.hit[lv], cur.post_miss[lv])

    def settle(self, going: np.ndarray) -> None:
        """After the round's tokens reached the rows: its lookups count for the rows that go on (the
        speculation they produced is verified next)."""
        self.stats.settle(going, self.prom)

    def drain(self, rnd: SSDRound) -> None:
        if rnd.lookup is not None:
            self._finish(rnd)
        jax.block_until_ready((rnd.out, self.sp.tokens))

    def metrics(self, wall: float, ttft: float, rounds: int) -> dict:
        return {**ssd_host.run_metrics(self, wall, ttft, rounds), "devices": device_metrics(self.pl)}

    def row_metrics(self, b: int) -> dict:
        return self.stats.row_metrics(b)
