"""SD with an EAGLE-style head (``--draft eagle:PATH``) in the engine: one compiled call per round on one
device (:mod:`ssd_jax.decoding.sd_eagle`), batch buckets, K fixed; a contiguous target cache (the head's
pending features are per slot, so no paging or prefix caching yet)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ssd_jax.decoding.sd_eagle import Pending, eagle_prefill_program, eagle_round_program
from ssd_jax.drafters import eagle
from ssd_jax.drafters.eagle import PREFIX, eagle_source, is_eagle, load_eagle
from ssd_jax.engine.core import RoundOut
from ssd_jax.decoding.slots import Rows
from ssd_jax.engine.methods.base import PREFILL_SAMPLINGS, Method, chunk_args
from ssd_jax.engine.methods.sd import SDRound

__all__ = ["PREFIX", "SDEagle", "eagle_source", "is_eagle", "load_eagle"]


class SDEagle(Method):
    name = "sd"
    speculates = True
    bucketed = True
    tree_slots = 0  # head-cache slots past the context (SSD's tree region)

    def __init__(self, model, modes, spec, head, meta, source: str):
        super().__init__(model, modes)
        self.spec, self.head_h, self.meta, self.source = spec, head, meta, source
        self.layers = tuple(int(i) for i in meta["layers"])
        self.K = int(spec.k)
        self.k_max, self.extra_slots = self.K, self.K + 1

    def setup_draft(self, engine) -> None:
        cfg = self.model.cfg
        self.head = jax.tree.map(self.put, eagle.attach_vocab(self.head_h, self.model.params, cfg))
        self.hcache = jax.tree.map(
            self.put, eagle.init_head_cache(cfg, self.B, self.max_len + self.tree_slots)
        )
        width = len(self.layers) * cfg.hidden_size
        self.pend = jax.tree.map(self.put, Pending.empty(self.B, self.K + 1, width, cfg.jnp_dtype))
        self._full = np.full(self.B, self.K, np.int32)

    def _program(self, mode, window, bucket):
        nf = mode.needs_filter and not mode.greedy
        return eagle_round_program(
            self.model.cfg, self.layers, self.K, nf, mode.greedy, self.window(window), self.bucket(bucket)
        )

    def _args(self, live, mode):
        return (self.model.params, self.tcache, self.head, self.hcache, self.pend, self.round_rows(mode),
                self.active(live))  # fmt: skip

    def compile_rounds(self, windows) -> None:
        off = np.zeros(self.B, bool)
        for b in self.buckets:
            for mode in self.modes:
                for w in windows:
                    self._program(mode, w, b).precompile(*self._args(off, mode))

    def compile_admission(self, chunks) -> None:
        """The head's prefill (the target's with the head's pairs) at each window and sampling."""
        put, zeros = self.put, np.zeros((1, chunks[0].tokens.shape[1]), np.int32)
        new = jax.tree.map(put, Rows.empty(1, self.n_ban))
        for c in chunks:
            for greedy, nf in PREFILL_SAMPLINGS:
                prog = eagle_prefill_program(
                    self.model.cfg, self.layers, c.whole, self.window(c.window), greedy, nf
                )
                prog.precompile(
                    self.model.params, self.tcache, self.rows, self.head, self.hcache, self.pend,
                    *chunk_args(c, put), new, put(zeros), put(zeros[:, 0]),
                )  # fmt: skip

    def admit(self, chunks, new):
        put = self.put
        new_d = jax.tree.map(put, new)
        greedy = bool((new.rs.temperature == 0).all())
        nf = not greedy and bool(((new.rs.top_k > 0) | (new.rs.top_p < 1)).any())
        prompts = [
            np.concatenate([c.tokens[r, : c.n_valid[r]] for c in chunks]) for r in range(len(chunks[0].slots))
        ]
        first = chunks[0].starts
        tok = lpc = None
        for c in chunks:
            nxt, n_head = _next_tokens(c, prompts, first)
            prog = eagle_prefill_program(
                self.model.cfg, self.layers, c.whole, self.window(c.window), greedy, nf
            )
            tok, lpc, self.tcache, self.rows, self.hcache, self.pend = prog(
                self.model.params, self.tcache, self.rows, self.head, self.hcache, self.pend, put(c.tokens),
                put(c.n_valid), put(c.slots), put(c.starts), new_d, put(nxt), put(n_head),
            )  # fmt: skip
        self._first_lp = lpc if bool(np.asarray(new.rs.want_logprobs).any()) else None
        return np.asarray(tok), self.first_logprobs()

    def dispatch(self, live, window, mode, bucket=None) -> SDRound:
        out, self.tcache, self.hcache, self.pend, (cur, prev, steps) = self._program(mode, window, bucket)(
            *self._args(live, mode)
        )
        self.rows = dataclasses.replace(self.rows, cur=cur, prev=prev, steps=steps)
        return SDRound(out, self.K, None, live, self.K)

    def read(self, rnd: SDRound, live, fresh) -> RoundOut:
        emitted, n_acc, lps = rnd.split(np.asarray(rnd.out))
        return RoundOut(emitted, n_acc + 1, self._full, logprobs=lps, k=self.K)

    def metrics(self, wall: float, ttft: float, rounds: int) -> dict:
        return {
            "k": self.K,
            "draft": self.source,
            "draft_s": None, "verify_s": None, "sample_s": None, "overhead_s": None,
            "calls_per_round": 1,
            "rounds_without_proposals": 0,
            "k_adaptive": False,
            "head_layers": list(self.layers),
        }  # fmt: skip


def _next_tokens(chunk, prompts, first):
    """The head's pairs of one prefill chunk: for each row, the token after each of its positions in the
    chunk (the prompt's next token) and how many pairs it has (the chunk's positions, less the prompt's
    last one, whose pair waits for the first sampled token)."""
    R, C = chunk.tokens.shape
    nxt = np.zeros((R, C), np.int32)
    n_head = np.zeros(R, np.int32)
    for r in range(R):
        nv = int(chunk.n_valid[r])
        if nv == 0:
            continue
        s = int(chunk.starts[r] - first[r])
        after = prompts[r][s + 1 : s + nv + 1]
        nxt[r, : len(after)] = after
        n_head[r] = len(after)
    return nxt, n_head
