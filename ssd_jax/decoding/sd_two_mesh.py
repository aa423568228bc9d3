"""SD with the target and the draft model on disjoint meshes (possibly in different processes
under ``jax.distributed``): each round is one draft call and one target call, with the proposals
(tokens and q) crossing to the target and the outcome (next ``cur``, ``prev``, catch-up flag, new
lengths, with the round's tokens for the host) crossing back; same keys as
:func:`ssd_jax.decoding.sd.sd_round`, so the same tokens as the one-device loop."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.decoding import runtime
from ssd_jax.decoding.batch import Batch, GenerationResult, seed_key
from ssd_jax.decoding.sd import accept_step, push_round, sd_result, target_score
from ssd_jax.decoding.stats import AcceptanceStats
from ssd_jax.drafters import make_drafter
from ssd_jax.drafters.model import draft_propose
from ssd_jax.parallel.placement import cache_for as _cache_for
from ssd_jax.sampling.filters import RowSampling


def sd_draft_side(
    dparams, dcache, lengths_B, cur_B, prev_B, catch_up, step, key, rs, *, dcfg, k, vocab, needs_filter
):
    """Two meshes, draft side: roll the draft cache to the committed lengths, then K proposals (the
    draft half of :func:`sd_round`, same key)."""
    dcache = dcache.with_lengths(lengths_B)
    kd = jax.random.fold_in(jax.random.fold_in(key, 1), step)

    def variant(c):
        def run(args):
            return draft_propose(*args, cfg=dcfg, k=k, vocab=vocab, needs_filter=needs_filter, catch_up=c)

        return run

    tokens, q, dcache = jax.lax.cond(
        catch_up, variant(True), variant(False), (dparams, dcache, prev_B, cur_B, kd, rs)
    )
    return tokens, q, dcache, step + 1


def sd_target_side(tparams, tcache, cur_B, tokens_BxK, q, step, key, rs, *, cfg, needs_filter):
    """Two meshes, target side: verify and rejection-sample (the target half of :func:`sd_round`).

    Returns (emitted (B, K+2), tcache, the outcome the draft needs: (cur, prev, catch_up, lengths),
    step + 1)."""
    B, K = tokens_BxK.shape
    n_draft = jnp.full((B,), K, jnp.int32)
    logits, tcache = target_score(tparams, tcache, cur_B, tokens_BxK, cfg=cfg)
    emitted, n, new_len, _, prev, cur = accept_step(
        jax.random.fold_in(key, 2),
        step,
        logits,
        tokens_BxK,
        n_draft,
        q,
        rs,
        tcache.lengths,
        cur_B,
        needs_filter=needs_filter,
    )
    out = jnp.concatenate([emitted, n[:, None]], axis=1)
    return out, tcache.with_lengths(new_len), (cur, prev, jnp.any(n >= n_draft), new_len + 0), step + 1


@functools.lru_cache(maxsize=32)
def sd_two_mesh_programs(cfg, dcfg, k, vocab, needs_filter):
    draft = runtime.Compiled(
        functools.partial(sd_draft_side, dcfg=dcfg, k=k, vocab=vocab, needs_filter=needs_filter),
        donate_argnums=(1,),
        name="sd_draft",
    )
    target = runtime.Compiled(
        functools.partial(sd_target_side, cfg=cfg, needs_filter=needs_filter),
        donate_argnums=(1,),
        name="sd_verify",
    )
    return draft, target


def generate_sd_two_meshes(model, prompts, ids, sampling, spec, on_text, load) -> GenerationResult:
    """SD with the target and the draft model on disjoint meshes (see the module docstring).

    Round T+1 is queued before round T is read: nothing on the way from one round to the next
    needs the host."""
    drafter = make_drafter(spec, model, sampling, load)
    from ssd_jax.drafters.base import check_same_tokenizer
    from ssd_jax.drafters.model import draft_prefill
    from ssd_jax.parallel.placement import place

    draft = drafter.model
    check_same_tokenizer(model, draft)
    batch = Batch.build(model, prompts, ids, sampling, spec, also_fits=(draft,))
    rows, B, K, tokens, n_valid, max_len = (
        batch.rows,
        batch.size,
        spec.k,
        batch.tokens,
        batch.n_valid,
        batch.max_len,
    )
    pl = place(model, draft, spec)
    target, draft = pl.target, pl.draft
    tput, dput = pl.put_target, pl.put_draft
    rs_host = RowSampling.broadcast(sampling, B)
    rs_t, rs_d = jax.tree.map(tput, rs_host), jax.tree.map(dput, rs_host)
    key_t, key_d = seed_key(sampling.seed, tput), seed_key(sampling.seed, dput)
    prefill, _ = runtime.ar_steps(target.cfg, sampling.needs_filter)
    dpre = runtime.Compiled(
        functools.partial(draft_prefill, cfg=draft.cfg), donate_argnums=(1,), name="draft_prefill"
    )
    dprog, tprog = sd_two_mesh_programs(target.cfg, draft.cfg, K, model.cfg.vocab_size, sampling.needs_filter)

    # --- compile everything up front
    tcache, dcache = _cache_for(target, B, max_len), _cache_for(draft, B, max_len)
    tok_t, nval_t, tok_d, nval_d = tput(tokens), tput(n_valid), dput(tokens), dput(n_valid)
    compile_s = prefill.precompile(target.params, tcache, tok_t, nval_t, key_t, rs_t)
    compile_s += dpre.precompile(draft.params, dcache, tok_d, nval_d)
    zB_d, false_d, one_d = dput(np.zeros(B, np.int32)), dput(np.bool_(False)), dput(np.int32(1))
    compile_s += dprog.precompile(draft.params, dcache, zB_d, zB_d, zB_d, false_d, one_d, key_d, rs_d)
    zB_t, one_t = tput(np.zeros(B, np.int32)), tput(np.int32(1))
    q0 = tput(np.zeros((B, K, model.cfg.vocab_size), np.float32))
    compile_s += tprog.precompile(
        target.params, tcache, zB_t, tput(np.zeros((B, K), np.int32)), q0, one_t, key_t, rs_t
    )
    if pl.bridge is not None:  # the moves between processes are collectives: compile them now
        a = time.perf_counter()
        zK_d = dput(np.zeros((B, K), np.int32))
        outcome0 = (zB_t, zB_t, tput(np.bool_(False)), zB_t)
        jax.block_until_ready(
            [
                pl.to_draft(zB_t),
                pl.to_target((zK_d, dput(np.zeros((B, K, model.cfg.vocab_size), np.float32)))),
                pl.to_draft((outcome0, tput(np.zeros((B, K + 2), np.int32)))),
            ]
        )
        compile_s += time.perf_counter() - a

    t0 = time.perf_counter()
    cur_t, tcache = prefill(target.params, tcache, tok_t, nval_t, key_t, rs_t)
    dcache = dpre(draft.params, dcache, tok_d, nval_d)  # queued behind the target's; both count towards ttft
    cur_d, cur_all = pl.to_draft(cur_t)
    first = pl.read(cur_all)
    jax.block_until_ready(dcache)  # the draft's prefill ends before decode time starts
    ttft = time.perf_counter() - t0
    batch.push_first(first, on_text)
    # the draft side's state: committed lengths (the prompts, written by its prefill), cur, prev, catch-up
    dstate = (dput(n_valid), cur_d, dput(batch.last_prompt_tokens()), false_d)
    st = {
        "tcache": tcache,
        "dcache": dcache,
        "cur_t": cur_t,
        "dstate": dstate,
        "step_t": one_t,
        "step_d": one_d,
    }

    def dispatch():
        lengths, cur_d, prev_d, catch_d = st["dstate"]
        toks, q, st["dcache"], st["step_d"] = dprog(
            draft.params, st["dcache"], lengths, cur_d, prev_d, catch_d, st["step_d"], key_d, rs_d
        )
        (toks_t, q_t), _ = pl.to_target((toks, q))
        out, st["tcache"], outcome, st["step_t"] = tprog(
            target.params, st["tcache"], st["cur_t"], toks_t, q_t, st["step_t"], key_t, rs_t
        )
        st["cur_t"] = outcome[0]
        ((cur, prev, catch, lengths), _), (_, out_all) = pl.to_draft((outcome, out))
        st["dstate"] = (lengths, cur, prev, catch)
        return out_all

    stats = AcceptanceStats(B, K)
    live = np.array([not r.done for r in rows])
    n_draft_h = np.full(B, K, np.int32)
    max_rounds = sampling.max_new_tokens  # every live row emits at least one token per round
    out = dispatch()
    dispatched, step, nxt = 1, 0, None
    while live.any():
        step += 1
        nxt = dispatch() if dispatched < max_rounds else None  # queue round T+1 before reading round T
        dispatched += nxt is not None
        host = pl.read(out)  # the round's one read: tokens and accepted counts
        stats.update(live, host[:, -1], n_draft_h)
        push_round(rows, live, host[:, :-1], host[:, -1], on_text)
        if nxt is None:
            break
        out = nxt
    wall = time.perf_counter() - t0
    if nxt is not None:
        jax.block_until_ready(nxt)  # don't leave a round running into the next call's timing

    stages = {
        "draft_s": None,
        "verify_s": None,
        "sample_s": None,
        "overhead_s": None,
        "round_s": wall - ttft,
        "calls_per_round": 2,
        "rounds_without_proposals": 0,
        "devices": {
            "single_device": False,
            "target": len(pl.target_devices),
            "draft": len(pl.draft_devices),
            "processes": jax.process_count(),
            "target_processes": sorted({d.process_index for d in pl.target_devices}),
            "draft_processes": sorted({d.process_index for d in pl.draft_devices}),
        },
    }
    return sd_result(batch, stats, drafter, K, step, wall, ttft, compile_s, stages)
