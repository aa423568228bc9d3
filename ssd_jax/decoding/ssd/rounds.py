"""The SSD round as compiled programs: one call on the target mesh (verify + rejection sampling),
the draft mesh's cache build and lookup, and, when both models share one device, the whole
round fused into ONE call.

Everything the host decides per round (the fan-out layouts, the rows it still considers live)
travels in one small int32 control vector, and every per-row decision the device can make is
made there: which layout a row's tree uses (by where its speculation came from), the step
counters, the random keys, which rows are done by length. So rounds can be queued without
reading the previous one; the host reads the emitted tokens and a per-row meta array after the
fact.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from ssd_jax.compile import Compiled
from ssd_jax.decoding.sd import accept_step, target_score
from ssd_jax.decoding.ssd import tree
from ssd_jax.decoding.ssd.tree import Opts
from ssd_jax.drafters.base import Proposal
from ssd_jax.drafters.model import draft_prefill
from ssd_jax.sampling.filters import fold_in

META = 4  # per-row meta columns: hit, post_miss, n_draft, live (as the device saw it)


@dataclasses.dataclass(frozen=True)
class Control:
    """Static layout of the per-round control vector (int32), see :func:`pack`.

    ``layouts``: K+2 branch layouts, one per row state: index 0 = a speculation from the cache or
    the neural backup (K proposals), 1 + n = a fast fallback's speculation with n proposals.
    """

    k: int
    budget: int
    batch: int

    @property
    def size(self) -> int:
        return 2 * (self.k + 2) * self.budget + self.k + self.batch

    def pack(self, kb, rb, fan, live) -> np.ndarray:
        """``kb``, ``rb``: (K+2, M) branch layouts; ``fan``: (K,) Saguaro fan-out; ``live``: (B,)."""
        return np.concatenate([np.ravel(kb), np.ravel(rb), np.ravel(fan), np.ravel(live)]).astype(np.int32)

    def unpack(self, ctrl):
        n = (self.k + 2) * self.budget
        shape = (self.k + 2, self.budget)
        kb, rb = ctrl[:n].reshape(shape), ctrl[n : 2 * n].reshape(shape)
        fan = ctrl[2 * n : 2 * n + self.k]
        live = ctrl[2 * n + self.k :] > 0
        return kb, rb, jnp.broadcast_to(fan, (self.batch, self.k)), live


def verify_round(tparams, tcache, cur_B, spec: Proposal, step, key, rs, *, cfg, needs_filter):
    """Target mesh: score the speculation, rejection-sample, advance the cache.

    Returns (emitted (B, K+2) = the round's tokens then n_accepted, outcome (B, 3) = what the
    draft needs: n_accepted, the next ``cur``, the new length; cur, tcache, step + 1).
    """
    logits, tcache = target_score(tparams, tcache, cur_B, spec.tokens, cfg=cfg)
    out, outcome, nxt, new_len, step = sample_round(
        key, step, logits, spec, rs, tcache.lengths, cur_B, needs_filter=needs_filter
    )
    return out, outcome, nxt, tcache.with_lengths(new_len), step


def sample_round(key, step, logits, spec: Proposal, rs, lengths_B, cur_B, *, needs_filter):
    """Rejection sampling alone (the profiled path's second target call); returns new lengths."""
    emitted, n, new_len, _, _, nxt = accept_step(
        key, step, logits, spec.tokens, spec.n_draft, spec.q, rs, lengths_B, cur_B, needs_filter=needs_filter
    )
    out = jnp.concatenate([emitted, n[:, None]], axis=1)
    return out, jnp.stack([n, nxt, new_len], axis=1), nxt, new_len, step + 1


def build_round(
    dparams, dcache, cur_B, spec: Proposal, post_miss_B, step, key, rs, ctrl, *, cfg, opts: Opts, ctl: Control
):
    """Draft mesh, concurrent with the verify: the speculation tree of this round's outcomes."""
    kb_tab, rb_tab, fan, _ = ctl.unpack(ctrl)
    row = jnp.where(post_miss_B, 1 + spec.n_draft, 0)
    return tree.build_tree(
        dparams,
        dcache,
        cur_B,
        spec.tokens,
        spec.n_draft,
        kb_tab[row],
        rb_tab[row],
        fan,
        fold_in(key, 2 * step),
        rs,
        cfg=cfg,
        opts=opts,
    )


def advance_round(
    dparams,
    tree_,
    dcache,
    outcome,
    n_valid_B,
    step,
    key,
    rs,
    ctrl,
    host_tokens,
    host_n,
    *,
    cfg,
    opts: Opts,
    ctl: Control,
    backup: str,
    max_new: int,
):
    """Draft mesh: look the outcome up in the tree; fallbacks for the rows that missed.

    Rows past their token budget count as done on the device (the host's mask covers EOS and
    stop strings, a round late). Returns (next speculation, its post-miss flags, meta (B, 4),
    draft cache, the next ``cur``, step + 1).
    """
    n_acc, bonus, new_len = outcome[:, 0], outcome[:, 1], outcome[:, 2]
    _, _, fan, host_live = ctl.unpack(ctrl)
    live = host_live & (new_len - n_valid_B + 1 < max_new)
    sp, dcache = tree.advance(
        dparams,
        tree_,
        dcache,
        n_acc,
        bonus,
        new_len,
        live,
        fold_in(key, 2 * step + 1),
        rs,
        fan,
        cfg=cfg,
        opts=opts,
        backup=backup,
        host_tokens=host_tokens,
        host_n=host_n,
    )
    post_miss = ~sp.hit if backup in ("random", "host") else jnp.zeros_like(sp.hit)
    meta = jnp.stack([sp.hit, post_miss, sp.n_draft, live], axis=1).astype(jnp.int32)
    return sp, post_miss, meta, dcache, bonus, step + 1


def fused_round(
    tparams,
    tcache,
    dparams,
    dcache,
    cur_B,
    spec: Proposal,
    post_miss_B,
    n_valid_B,
    step,
    kverify,
    kdraft,
    rs,
    ctrl,
    *,
    cfg,
    dcfg,
    opts: Opts,
    ctl: Control,
    backup: str,
    max_new: int,
    needs_filter: bool,
):
    """Both models on one device: verify, build and advance in one call (same keys, same tokens).

    Returns (host array (B, K+2+4): emitted, n_accepted, then the next speculation's meta;
    next speculation, its post-miss flags, tcache, dcache, cur, step + 1).
    """
    out, outcome, nxt, tcache, _ = verify_round(
        tparams, tcache, cur_B, spec, step, kverify, rs, cfg=cfg, needs_filter=needs_filter
    )
    tree_, dcache = build_round(
        dparams, dcache, cur_B, spec, post_miss_B, step, kdraft, rs, ctrl, cfg=dcfg, opts=opts, ctl=ctl
    )
    B, K = cur_B.shape[0], opts.k
    sp, pm, meta, dcache, _, _ = advance_round(
        dparams,
        tree_,
        dcache,
        outcome,
        n_valid_B,
        step,
        kdraft,
        rs,
        ctrl,
        jnp.zeros((B, K), jnp.int32),
        jnp.zeros((B,), jnp.int32),
        cfg=dcfg,
        opts=opts,
        ctl=ctl,
        backup=backup,
        max_new=max_new,
    )
    return jnp.concatenate([out, meta], axis=1), sp, pm, tcache, dcache, nxt, step + 1


def first_round(dparams, dcache, cur_B, key, rs, ctrl, *, cfg, opts: Opts, ctl: Control, backup: str):
    """The first speculation (no tree yet), with its post-miss flags."""
    _, _, fan, _ = ctl.unpack(ctrl)
    sp, dcache = tree.first_spec(
        dparams, dcache, cur_B, fold_in(key, 0), rs, fan, cfg=cfg, opts=opts, backup=backup
    )
    return sp, jnp.full(cur_B.shape, backup == "random"), dcache


@functools.lru_cache(maxsize=32)
def ssd_programs(tcfg, dcfg, opts: Opts, ctl: Control, needs_filter: bool, max_new: int):
    """Every compiled program of an SSD run, by name."""
    p = functools.partial
    adv = {
        f"advance_{b}": Compiled(
            p(advance_round, cfg=dcfg, opts=opts, ctl=ctl, backup=b, max_new=max_new),
            donate_argnums=(2,),
            name=f"advance_{b}",
        )
        for b in ("neural", "random", "host")
    }
    fused = {
        f"round_{b}": Compiled(
            p(
                fused_round,
                cfg=tcfg,
                dcfg=dcfg,
                opts=opts,
                ctl=ctl,
                backup=b,
                max_new=max_new,
                needs_filter=needs_filter,
            ),
            donate_argnums=(1, 3),
            name=f"ssd_round_{b}",
        )
        for b in ("neural", "random")
    }
    first = {
        f"first_{b}": Compiled(
            p(first_round, cfg=dcfg, opts=opts, ctl=ctl, backup=b), donate_argnums=(1,), name=f"first_{b}"
        )
        for b in ("neural", "random")
    }
    return {
        "draft_prefill": Compiled(p(draft_prefill, cfg=dcfg), donate_argnums=(1,), name="draft_prefill"),
        "verify": Compiled(
            p(verify_round, cfg=tcfg, needs_filter=needs_filter), donate_argnums=(1,), name="verify"
        ),
        "score": Compiled(p(target_score, cfg=tcfg), donate_argnums=(1,), name="score"),
        "sample": Compiled(p(sample_round, needs_filter=needs_filter), name="sample"),
        "build": Compiled(p(build_round, cfg=dcfg, opts=opts, ctl=ctl), donate_argnums=(1,), name="build"),
        **adv,
        **fused,
        **first,
    }
