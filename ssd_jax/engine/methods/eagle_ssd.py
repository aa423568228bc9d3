"""SSD with an EAGLE-style head (``--method ssd --draft HEAD``) in the engine: one compiled call a round on
the target's device (:mod:`ssd_jax.decoding.ssd.head`): the verify, the tree the head builds from its own
features, the lookup and the neural backup. The fan-out schedule is SSD's (geometric by default, adapting
to the acceptance seen with one slot), the hit statistics and metrics too.

Both run in one program here, one after the other; the head on hardware of its own (a draft process that
receives the target's features of each round's kept positions) is not built yet, so this measures the
hit rate and the acceptance the tree keeps, not SSD's overlap."""

from __future__ import annotations

import jax
import numpy as np

from ssd_jax.decoding.ssd.head import ssd_head_programs
from ssd_jax.decoding.ssd.rounds import META
from ssd_jax.decoding.ssd.tree import Opts
from ssd_jax.drafters.base import Proposal
from ssd_jax.engine.core import RoundOut
from ssd_jax.engine.methods.eagle import SDEagle
from ssd_jax.decoding.ssd.host import SpecMeta, SSDStats
from ssd_jax.engine.methods.fanout_tables import FanoutTables
from ssd_jax.engine.methods.ssd_rounds import SSDRound
from ssd_jax.sampling.logprobs import host_logprobs


class SSDEagle(SDEagle):
    name = "ssd"
    bucketed = False

    def __init__(self, model, modes, spec, head, meta, source: str):
        super().__init__(model, modes, spec, head, meta, source)
        self.fanout = FanoutTables(spec, 1)
        self.M = self.fanout.M
        self.tree_slots = self.M * self.K  # the tree region of the head's cache
        self.carry_q = any(not m.greedy for m in self.modes)

    def setup_draft(self, engine) -> None:
        super().setup_draft(engine)
        B, K, M, cfg = self.B, self.K, self.M, self.model.cfg
        tok = self.model.tokenizer
        self.opts = Opts(
            k=K, budget=M, vocab=cfg.vocab_size, rand_vocab=tok.vocab_size if tok is not None else cfg.vocab_size,
            needs_filter=False, greedy=not self.carry_q, c=float(self.spec.saguaro_c), tree_base=self.max_len,
        )  # fmt: skip
        self.fanout.bind(B, self.put)
        q = None if not self.carry_q else np.full((B, K, cfg.vocab_size), -np.inf, np.float32)
        sp = Proposal(np.zeros((B, K), np.int32), np.full(B, K, np.int32), q, np.zeros(B, bool))
        self.sp = jax.tree.map(self.put, sp)
        self.spec_meta = SpecMeta.empty(B)  # the speculation each row's next round verifies
        self.stats = SSDStats(B)
        self.prom = engine.metrics  # the server's Prometheus metrics, if any

    def _progs(self, mode, window=None, admission=False):
        import dataclasses

        greedy = not self.carry_q or (mode.greedy and not admission)
        opts = dataclasses.replace(self.opts, needs_filter=mode.needs_filter and not greedy, greedy=greedy)
        nf = mode.needs_filter and not mode.greedy  # the verify's
        return ssd_head_programs(
            self.model.cfg,
            self.layers,
            opts,
            self.fanout.ctl,
            nf,
            mode.greedy,
            self.window(window or self.max_len),
        )

    def compile_rounds(self, windows) -> None:
        off = np.zeros(self.B, bool)
        for mode in self.modes:
            for w in windows:
                self._progs(mode, w)["round"].precompile(*self._round_args(off))

    def _round_args(self, live):
        return (self.model.params, self.tcache, self.head, self.hcache, self.pend, self.rows, self.sp,
                self.active(live), self.fanout.ctrl(live))  # fmt: skip

    def compile_admission(self, chunks) -> None:
        super().compile_admission(chunks)
        first = self._progs(self.modes[0], admission=True)["first"]
        first.precompile(
            self.head, self.model.params, self.hcache, self.pend, self.rows, self.sp,
            self.put(np.zeros(1, np.int32)), self.fanout.ctrl(np.zeros(self.B, bool)),
        )  # fmt: skip

    def admit(self, chunks, new):
        tok, lps = super().admit(chunks, new)
        slots = chunks[0].slots
        live = np.zeros(self.B, bool)
        live[slots] = True
        first = self._progs(self.modes[0], admission=True)["first"]
        self.sp, self.hcache = first(
            self.head, self.model.params, self.hcache, self.pend, self.rows, self.sp, self.put(slots),
            self.fanout.ctrl(live),
        )  # fmt: skip
        self.spec_meta.drafted(slots, self.K)
        return tok, lps

    def dispatch(self, live, window, mode, bucket=None) -> SSDRound:
        import dataclasses

        out, self.sp, self.tcache, self.hcache, self.pend, (cur, prev, steps) = self._progs(mode, window)[
            "round"
        ](*self._round_args(live))
        self.rows = dataclasses.replace(self.rows, cur=cur, prev=prev, steps=steps)
        return SSDRound("neural", self.fanout.sched, out)

    def read(self, rnd: SSDRound, live, fresh) -> RoundOut:
        K = self.K
        out_h = np.asarray(rnd.out)
        n_acc = out_h[:, K + 1]
        nxt = SpecMeta.read(out_h[:, K + 2 : K + 2 + META])
        lps = host_logprobs(out_h, K + 2 + META, K + 1)
        cur = self.spec_meta
        self._learn(rnd, live, n_acc, cur, nxt)
        self.spec_meta = cur.updated(nxt, keep=fresh)
        self.fanout.refresh()
        return RoundOut(out_h[:, : K + 1], n_acc + 1, cur.n_draft, cur.hit, logprobs=lps)

    def _learn(self, rnd, lv, n_acc, cur: SpecMeta, nxt: SpecMeta) -> None:
        self.stats.count_round(lv, n_acc, cur, nxt, "neural")
        if lv.any():  # (no fast backup: no row drafts after a miss)
            no_miss = np.zeros(int(lv.sum()), bool)
            self.fanout.observe(rnd.sched, n_acc[lv], cur.n_draft[lv], nxt.hit[lv], no_miss)

    def settle(self, going: np.ndarray) -> None:
        self.stats.settle(going, self.prom)

    def metrics(self, wall: float, ttft: float, rounds: int) -> dict:
        return {
            **super().metrics(wall, ttft, rounds),
            **self.stats.summary(),
            "fanout": self.fanout.summary(),
            "saguaro_c": float(self.spec.saguaro_c),
            "backup": "neural",
            "overlap": False,
        }

    def bucket_note(self) -> str:
        """The server's start-up line: SSD with a head runs every slot each round (no AR buckets)."""
        return " head=on-target-device"

    def row_metrics(self, b: int) -> dict:
        return self.stats.row_metrics(b)
