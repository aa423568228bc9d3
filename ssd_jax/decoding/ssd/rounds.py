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

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.compile import Compiled, program_factory
from ssd_jax.decoding.sd import accept_step, target_score
from ssd_jax.decoding.ssd import tree
from ssd_jax.decoding.ssd.tree import Opts
from ssd_jax.drafters.base import Proposal
from ssd_jax.decoding.slots import (
    gather_rows,
    pad_rows,
    park,
    put_rows,
    scatter_rows,
    set_rows,
    take_rows,
    windowed,
)
from ssd_jax.models import llama
from ssd_jax.sampling.filters import fold_in

#: the per-row record of the next speculation that a round sends the host, as the device saw it (its columns
#: in this order; the host reads them back by name: :class:`ssd_jax.decoding.ssd.host.SpecMeta`)
META_FIELDS = ("hit", "post_miss", "n_draft", "live")
META = len(META_FIELDS)


def pack_meta(**fields) -> jax.Array:
    """(B, META) int32: the named per-row fields of :data:`META_FIELDS`, each (B,), in their order."""
    return jnp.stack([jnp.asarray(fields[name]) for name in META_FIELDS], axis=1).astype(jnp.int32)


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


def verify_round(tparams, tcache, cur_B, spec: Proposal, step, key, rs, *, cfg, needs_filter, greedy=False):
    """Target mesh: score the speculation, rejection-sample, advance the cache.

    ``greedy`` (static): every row of the round is greedy, so only the argmax matching runs (the same
    outcome, and no random draws: XLA:CPU runs each threefry hash as a loop of its own).
    Returns (host array (B, K+2+P) = the round's tokens, n_accepted, log-probability columns; outcome (B, 3) = what the
    draft needs: n_accepted, the next ``cur``, the new length; cur, tcache, step + 1).
    """
    logits, tcache = target_score(tparams, tcache, cur_B, spec.tokens, cfg=cfg)
    out, outcome, nxt, new_len, step = sample_round(
        key, step, logits, spec, rs, tcache.lengths, cur_B, needs_filter=needs_filter, greedy=greedy
    )
    return out, outcome, nxt, tcache.with_lengths(new_len), step


def sample_round(key, step, logits, spec: Proposal, rs, lengths_B, cur_B, *, needs_filter, greedy=False):
    """Rejection sampling alone (the profiled path's second target call); returns new lengths."""
    emitted, n, new_len, _, _, nxt, lpc = accept_step(
        key, step, logits, spec.tokens, spec.n_draft, spec.q, rs, lengths_B, cur_B, needs_filter=needs_filter,
        greedy=greedy,
    )  # fmt: skip
    out = jnp.concatenate([emitted, n[:, None], lpc], axis=1)
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
    limit_B,
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
):
    """Draft mesh: look the outcome up in the tree; fallbacks for the rows that missed.

    Rows past their token budget count as done on the device (the host's mask covers EOS and
    stop strings, a round late). Returns (next speculation, its post-miss flags, meta (B, 4),
    draft cache, the next ``cur``, step + 1).
    """
    n_acc, bonus, new_len = outcome[:, 0], outcome[:, 1], outcome[:, 2]
    _, _, fan, host_live = ctl.unpack(ctrl)
    live = host_live & (new_len + 1 < limit_B)  # limit: prompt length + max new tokens
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
    meta = pack_meta(hit=sp.hit, post_miss=post_miss, n_draft=sp.n_draft, live=live)
    return sp, post_miss, meta, dcache, bonus, step + 1


def fused_round(
    tparams,
    tcache,
    dparams,
    dcache,
    cur_B,
    spec: Proposal,
    post_miss_B,
    limit_B,
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
    needs_filter: bool,
):
    """Both models on one device: verify, build and advance in one call (same keys, same tokens).

    Returns (host array (B, K+2+4+P): emitted, n_accepted, the next speculation's meta, then the
    log-probability columns;
    next speculation, its post-miss flags, tcache, dcache, cur, step + 1).
    """
    out, outcome, nxt, tcache, _ = verify_round(
        tparams, tcache, cur_B, spec, step, kverify, rs, cfg=cfg, needs_filter=needs_filter, greedy=opts.greedy,
    )  # fmt: skip
    tree_, dcache = build_round(
        dparams, dcache, cur_B, spec, post_miss_B, step, kdraft, rs, ctrl, cfg=dcfg, opts=opts, ctl=ctl
    )
    B, K = cur_B.shape[0], opts.k
    sp, pm, meta, dcache, _, _ = advance_round(
        dparams,
        tree_,
        dcache,
        outcome,
        limit_B,
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
    )
    host = jnp.concatenate([out[:, : K + 2], meta, out[:, K + 2 :]], axis=1)  # meta before the log-probs
    if sp.q is None and spec.q is not None:  # a greedy round (opts.greedy): the speculations keep their q
        sp = dataclasses.replace(sp, q=spec.q)
    return host, sp, pm, tcache, dcache, nxt, step + 1


def fused_slot_round(
    tparams, tcache, dparams, dcache, rows, sp, pm, active_B, ctrl, *, ctl, bucket=None, **kw
):
    """:func:`fused_round` over the engine's slots (row keys and steps, free slots parked); ``bucket``
    (static): only the first ``bucket`` slots run (every running row is among them; the caches' buffers
    stay whole and are written in place, ``llama.bucket_view``).
    Returns (host array (B, K+2+4), next speculation, post-miss flags, tcache, dcache, rows)."""
    r, s, p, act = take_rows((rows, sp, pm, active_B), bucket)
    if bucket is not None:  # the control vector ends with the live flags: keep the bucket's
        ctl = dataclasses.replace(ctl, batch=bucket)
        ctrl = ctrl[: ctl.size]
    keys = r.key_batch
    out, s, p, tc, dc, nxt, _ = fused_round(
        tparams, llama.bucket_view(tcache, bucket), dparams, llama.bucket_view(dcache, bucket), r.cur, s, p,
        r.limit, r.steps, fold_in(keys, 2), fold_in(keys, 1), r.rs, ctrl, ctl=ctl, **kw,
    )  # fmt: skip
    tcache = llama.bucket_merge(tcache, park(tc, act), bucket)
    dcache = llama.bucket_merge(dcache, park(dc, act), bucket)
    sp, pm = put_rows((sp, pm), (s, p), bucket)
    cur, steps = put_rows((rows.cur, rows.steps), (nxt, r.steps + 1), bucket)
    rows = dataclasses.replace(rows, cur=cur, steps=steps)
    return pad_rows(out, active_B.shape[0]), sp, pm, tcache, dcache, rows


def _bucket_ctl(ctl: Control, ctrl, bucket: int | None):
    """The control of a bucket's rows: the vector ends with the live flags, so its first part is theirs."""
    if bucket is None:
        return ctl, ctrl
    ctl = dataclasses.replace(ctl, batch=bucket)
    return ctl, ctrl[: ctl.size]


def verify_slot(
    tparams, tcache, rows, spec: Proposal, active_B, *, cfg, needs_filter, greedy=False, bucket=None
):
    """Target mesh: :func:`verify_round` over the slots (``bucket``, static: the first ``bucket`` only).
    Returns (emitted (B, ...), the bucket's outcome, tcache, rows)."""
    r, s, act = take_rows((rows, spec, active_B), bucket)
    out, outcome, nxt, tc, _ = verify_round(
        tparams, llama.bucket_view(tcache, bucket), r.cur, s, r.steps, fold_in(r.key_batch, 2), r.rs, cfg=cfg,
        needs_filter=needs_filter, greedy=greedy,
    )  # fmt: skip
    tcache = llama.bucket_merge(tcache, park(tc, act), bucket)
    cur, steps = put_rows((rows.cur, rows.steps), (nxt, r.steps + 1), bucket)
    return pad_rows(out, active_B.shape[0]), outcome, tcache, dataclasses.replace(rows, cur=cur, steps=steps)


def sample_slot(logits, tcache, rows, spec: Proposal, active_B, *, needs_filter, greedy=False):
    """The profiled path's second target call: rejection sampling after :func:`target_score`."""
    out, outcome, nxt, new_len, _ = sample_round(
        fold_in(rows.key_batch, 2), rows.steps, logits, spec, rows.rs, tcache.lengths, rows.cur,
        needs_filter=needs_filter, greedy=greedy,
    )  # fmt: skip
    tcache = park(tcache.with_lengths(new_len), active_B)
    return out, outcome, tcache, dataclasses.replace(rows, cur=nxt, steps=rows.steps + 1)


def build_slot(dparams, dcache, rows, sp: Proposal, pm, ctrl, *, cfg, opts: Opts, ctl: Control, bucket=None):
    """Draft mesh: :func:`build_round` over the slots (the rows' cur and step, their draft keys; ``bucket``:
    the first ``bucket`` slots only). Returns (the bucket's tree, dcache)."""
    r, s, p = take_rows((rows, sp, pm), bucket)
    ctl, ctrl = _bucket_ctl(ctl, ctrl, bucket)
    tree_, dc = build_round(
        dparams, llama.bucket_view(dcache, bucket), r.cur, s, p, r.steps, fold_in(r.key_batch, 1), r.rs, ctrl,
        cfg=cfg, opts=opts, ctl=ctl,
    )  # fmt: skip
    return tree_, llama.bucket_merge(dcache, dc, bucket)


def advance_slot(
    dparams,
    tree_,
    dcache,
    outcome,
    rows,
    ctrl,
    host_tokens,
    host_n,
    active_B,
    sp,
    pm,
    *,
    ctl,
    bucket=None,
    **kw,
):
    """Draft mesh: :func:`advance_round` over the slots (``bucket``: the first ``bucket`` only, the others'
    speculations ``sp`` / ``pm`` kept). Returns (sp, post-miss, meta (B, 4), dcache, rows)."""
    r, ht, hn, act = take_rows((rows, host_tokens, host_n, active_B), bucket)
    ctl, ctrl = _bucket_ctl(ctl, ctrl, bucket)
    s, p, meta, dc, nxt, _ = advance_round(
        dparams, tree_, llama.bucket_view(dcache, bucket), outcome, r.limit, r.steps, fold_in(r.key_batch, 1),
        r.rs, ctrl, ht, hn, ctl=ctl, **kw,
    )  # fmt: skip
    if s.q is None and sp.q is not None:  # a greedy round: the speculations keep their q
        s = dataclasses.replace(s, q=take_rows(sp.q, bucket))
    dcache = llama.bucket_merge(dcache, park(dc, act), bucket)
    cur, steps = put_rows((rows.cur, rows.steps), (nxt, r.steps + 1), bucket)
    sp, pm = put_rows((sp, pm), (s, p), bucket)
    return sp, pm, pad_rows(meta, active_B.shape[0]), dcache, dataclasses.replace(rows, cur=cur, steps=steps)


def first_slot(dparams, dcache, rows, sp: Proposal, pm, slots_R, new, ctrl, *, cfg, opts, ctl, backup, whole):
    """Admission on the draft mesh: the new rows' state (``new.cur`` = each row's first token) and their
    first speculation (no tree yet: neural drafting or random point masses), written into the batch's."""
    _, _, fan, _ = ctl.unpack(ctrl)
    part = gather_rows(dcache, slots_R, dcache.lengths[slots_R], whole)
    key = fold_in(fold_in(jax.random.wrap_key_data(new.keys), 1), 0)
    first, part = tree.first_spec(
        dparams, part, new.cur, key, new.rs, fan[slots_R], cfg=cfg, opts=opts, backup=backup
    )
    put = lambda x, y: x.at[slots_R].set(y.astype(x.dtype))  # noqa: E731
    sp = Proposal(
        put(sp.tokens, first.tokens), put(sp.n_draft, first.n_draft),
        None if sp.q is None else put(sp.q, first.q), put(sp.hit, first.hit),
    )  # fmt: skip
    pm = pm.at[slots_R].set(backup == "random")
    return sp, pm, scatter_rows(dcache, part, slots_R, whole), set_rows(rows, slots_R, new)


def catch_up_slot(dparams, dcache, rows, sp: Proposal, pm, lag, lag_n, ctrl, *, cfg, opts, ctl, bucket=None):
    """SSD's return from AR rounds (K = 0): the idle draft's cache level with the target's again (the
    recorded tokens written from its own length, :func:`ssd_jax.decoding.sd_lag.draft_flush`) and a new
    speculation drafted from each such row's ``cur`` (neural, as at admission). Rows without recorded
    tokens keep their speculation. Returns (sp, post-miss flags, dcache, zero counts)."""
    from ssd_jax.decoding.sd_lag import LAG_MAX, draft_flush

    _, _, fan, _ = ctl.unpack(ctrl)
    need = lag_n > 0
    dcache, lag_n = draft_flush(dparams, dcache, lag, lag_n, dcfg=cfg, width=LAG_MAX, bucket=bucket, back=0)
    r, s, nd, f = take_rows((rows, sp, need, fan), bucket)
    key = fold_in(fold_in(r.key_batch, 3), r.steps)  # a stream of its own (verify: 2, tree and lookup: 1)
    toks, q, part = tree.draft_chain(
        dparams, llama.bucket_view(dcache, bucket), r.cur, key, r.rs, f, cfg=cfg, opts=opts
    )
    dcache = llama.bucket_merge(dcache, part, bucket)
    new = Proposal(
        jnp.where(nd[:, None], toks, s.tokens),
        jnp.where(nd, opts.k, s.n_draft),
        None if s.q is None else jnp.where(nd[:, None, None], q, s.q),
        s.hit & ~nd,
    )
    sp = put_rows(sp, new, bucket)
    return sp, pm & ~need, dcache, lag_n


@program_factory
def ssd_programs(tcfg, dcfg, opts: Opts, ctl: Control, window: int | None = None, bucket: int | None = None):
    """Every compiled program of SSD over the engine's slots, by name (the window applies to the target's
    cache only: the draft's tree region lies past the context). ``bucket``: the rounds, fused or split, run
    the first ``bucket`` slots only (admission and the profiled stages run every slot)."""
    p, nf, g, bk = functools.partial, opts.needs_filter, opts.greedy, bucket
    C = Compiled
    progs = {
        "verify": C(windowed(p(verify_slot, cfg=tcfg, needs_filter=nf, greedy=g, bucket=bk), window, (1,)), donate_argnums=(1,), name=f"verify_b{bk}"),
        "score": C(windowed(p(target_score, cfg=tcfg), window, (1,)), donate_argnums=(1,), name="score"),
        "sample": C(p(sample_slot, needs_filter=nf, greedy=g), name="sample"),
        "build": C(p(build_slot, cfg=dcfg, opts=opts, ctl=ctl, bucket=bk), donate_argnums=(1,), name=f"build_b{bk}"),
    }  # fmt: skip
    for b in ("neural", "random", "host"):
        fn = p(advance_slot, cfg=dcfg, opts=opts, ctl=ctl, backup=b, bucket=bk)
        progs[f"advance_{b}"] = C(fn, donate_argnums=(2,), name=f"advance_{b}_b{bk}")
    for b in ("neural", "random"):
        fn = p(
            fused_slot_round,
            cfg=tcfg,
            dcfg=dcfg,
            opts=opts,
            ctl=ctl,
            backup=b,
            needs_filter=nf,
            bucket=bucket,
        )
        progs[f"round_{b}"] = C(
            windowed(fn, window, (1,)), donate_argnums=(1, 3), name=f"ssd_round_{b}_b{bucket}"
        )
        for whole in (False, True):
            fn = p(first_slot, cfg=dcfg, opts=opts, ctl=ctl, backup=b, whole=whole)
            progs[f"first_{b}_{whole}"] = C(fn, donate_argnums=(1,), name=f"first_{b}")
    fn = p(catch_up_slot, cfg=dcfg, opts=opts, ctl=ctl, bucket=bucket)
    progs["catch_up"] = C(fn, donate_argnums=(1, 6), name=f"ssd_catch_up_b{bucket}")
    return progs
