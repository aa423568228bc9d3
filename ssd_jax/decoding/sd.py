"""Speculative decoding (SD): the round loop, ragged over the batch, and its accounting.

State between rounds, per row: the committed context (prompt + emitted tokens, all in the
target cache) and ``cur``, the last emitted token, which no cache holds yet. One round:

1. draft   - the drafter proposes up to K tokens after ``cur`` (``drafters.py``);
2. verify  - the target scores ``[cur, s_1..s_K]`` in ONE forward pass at each row's own
             offset, giving K+1 next-token distributions;
3. sample  - exact rejection sampling (``verify.py``) decides n_accepted per row and draws the
             bonus / correction token, which becomes the next ``cur``.

Rows accept different numbers of tokens; both caches advance per row by resetting their
lengths (rejected slots are simply overwritten later). Each stage is one compiled call; the
host blocks after each only to time it (the draft / verify / sample / overhead breakdown of
the vLLM study), which costs microseconds next to a forward pass.

``mean_acceptance_length`` is tokens emitted per verify step INCLUDING the bonus token;
``acceptance_rate`` is accepted / drafted proposals.

With ``target_devices`` / ``draft_devices`` and a draft model, target and draft live on disjoint
meshes (possibly in different processes under ``jax.distributed``): each round is one draft call
and one target call, with the proposals (tokens and q) crossing to the target and the outcome
(next ``cur``, ``prev``, catch-up flag, new lengths, with the round's tokens for the host) crossing
back (:mod:`ssd_jax.decoding.sd_two_mesh`); same keys as :func:`sd_round`, so the same tokens.
"""

from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.analysis.kchoice import OnlineK
from ssd_jax.decoding import runtime
from ssd_jax.decoding.batch import Batch, GenerationResult, seed_key
from ssd_jax.decoding.stats import AcceptanceStats
from ssd_jax.drafters import make_drafter
from ssd_jax.drafters.model import draft_propose
from ssd_jax.drafters.ngram import ngram_proposals
from ssd_jax.drafters.random import random_tokens
from ssd_jax.models import llama
from ssd_jax.parallel.placement import cache_for as _cache_for
from ssd_jax.parallel.placement import put_on as _put
from ssd_jax.sampling.filters import RowSampling, fold_in
from ssd_jax.sampling.rejection import emitted_tokens, verify, verify_greedy


def host_width(n_draft_h: np.ndarray, live: np.ndarray, k: int) -> int:
    """How many proposal columns a host-drafted round verifies: ``k``, or 0 when no live row has a
    proposal (an n-gram miss everywhere), so that round costs one target step, not a (k+1)-token verify.
    Both SD loops use it, so seeded runs draw the same tokens on either."""
    return k if bool((n_draft_h[live] > 0).any()) else 0


def target_score(params, cache, cur_B, draft_BxK, *, cfg):
    """Target logits at the K+1 positions ``[cur, s_1..s_K]`` (cache lengths unchanged)."""
    toks = jnp.concatenate([cur_B[:, None], draft_BxK], axis=1)
    h, cache = llama.forward(params, cfg, toks, cache)
    return llama.logits(params, cfg, h), cache


def accept_step(
    key, step, logits, draft_BxK, n_draft_B, q, rs, lengths_B, cur_B, *, needs_filter, greedy=False
):
    """Rejection sampling + the per-row state update; returns what the host and next round need.
    ``greedy`` (static): every row is greedy, so only the argmax matching runs (the same outcome)."""
    if greedy:
        res = verify_greedy(logits, draft_BxK, n_draft_B)
    else:
        res = verify(fold_in(key, step), logits, draft_BxK, n_draft_B, rs, needs_filter, q)
    n = res.n_accepted
    if draft_BxK.shape[1] == 0:  # a round with nothing proposed: one plain target step
        prev = cur_B
    else:
        prev = jnp.where(
            n > 0, jnp.take_along_axis(draft_BxK, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0], cur_B
        )
    new_len = lengths_B + 1 + n
    # two output buffers: the target's and the draft's caches are donated separately
    return emitted_tokens(draft_BxK, res), n, new_len, new_len + 0, prev, res.next_token


def push_round(rows, live, emitted_h, n_acc_h, on_text, history=None) -> None:
    """Hand a round's emitted tokens to the live rows (EOS / stop / length checks, streaming).

    Row b emitted ``n_acc_h[b] + 1`` tokens; a row that stops mid-round drops the rest and
    leaves ``live``. ``history`` (n-gram drafters) gets the tokens appended per row.
    """
    for b in np.flatnonzero(live):
        r = rows[b]
        new_toks = emitted_h[b, : n_acc_h[b] + 1]
        if history is not None:
            history[b] = np.concatenate([history[b], new_toks])
        for t in new_toks.tolist():
            new = r.push(t)
            if new and on_text is not None:
                on_text(b, new)
            if r.done:
                live[b] = False
                break


def sd_round(
    tparams,
    tcache,
    dparams,
    dcache,
    cur_B,
    prev_B,
    catch_up,
    step,
    key,
    rs,
    host_tokens_BxK,
    host_n_B,
    *,
    cfg,
    dcfg,
    k,
    vocab,
    rand_vocab,
    needs_filter,
    kind,
    greedy=False,
):
    """One whole SD round in one compiled call: draft K tokens, verify, rejection-sample, advance.

    ``kind``: "model" (the draft model; its catch-up variant chosen on device by ``lax.cond``),
    "random" (uniform proposals) or "host" (proposals computed on the host, e.g. n-gram lookup,
    passed in ``host_tokens_BxK`` / ``host_n_B``). ``step`` (a device scalar) and ``catch_up``
    come from the previous round's outputs, so rounds can be queued without the host.
    ``greedy`` (static): every row is at temperature 0, so the draft takes its argmax (no q) and the
    verify only matches argmaxes: the same tokens without the sampling work over the vocabulary.
    Randomness is that of the profiled path (same seed, same tokens). ``key`` and ``step`` may also be
    a (B,) batch of row keys and per-row steps (the server: each request draws from its own stream;
    not with ``kind="random"``).

    Returns (emitted (B, K+2): the round's tokens then n_accepted in the last column, n_draft,
    tcache, dcache, cur, prev, catch_up, step + 1).
    """
    B = cur_B.shape[0]
    kdraft, kverify = fold_in(key, 1), fold_in(key, 2)
    kd = fold_in(kdraft, step)
    q = None
    n_draft = jnp.full((B,), k, jnp.int32)
    if kind == "model":

        def variant(c):
            def run(args):
                return draft_propose(
                    *args, cfg=dcfg, k=k, vocab=vocab, needs_filter=needs_filter, catch_up=c, greedy=greedy
                )

            return run

        tokens, q, dcache = jax.lax.cond(
            catch_up, variant(True), variant(False), (dparams, dcache, prev_B, cur_B, kd, rs)
        )
    elif kind == "random":
        tokens = random_tokens(kd, B, k, rand_vocab)
    else:
        tokens, n_draft = host_tokens_BxK, host_n_B
    logits, tcache = target_score(tparams, tcache, cur_B, tokens, cfg=cfg)
    emitted, n, new_len, _, prev, cur = accept_step(
        kverify,
        step,
        logits,
        tokens,
        n_draft,
        q,
        rs,
        tcache.lengths,
        cur_B,
        needs_filter=needs_filter,
        greedy=greedy,
    )
    tcache = tcache.with_lengths(new_len)
    if dcache is not None:
        dcache = dcache.with_lengths(new_len + 0)  # its own buffer: both caches are donated
    out = jnp.concatenate([emitted, n[:, None]], axis=1)
    return out, n_draft, tcache, dcache, cur, prev, jnp.any(n >= n_draft), step + 1


@functools.lru_cache(maxsize=64)
def sd_round_program(cfg, dcfg, k, vocab, rand_vocab, needs_filter, kind, greedy=False):
    fn = functools.partial(
        sd_round,
        cfg=cfg,
        dcfg=dcfg,
        k=k,
        vocab=vocab,
        rand_vocab=rand_vocab,
        needs_filter=needs_filter,
        kind=kind,
        greedy=greedy,
    )
    return runtime.Compiled(fn, donate_argnums=(1, 3), name="sd_round")


@functools.lru_cache(maxsize=64)
def sd_steps(cfg, needs_filter: bool):
    score = runtime.Compiled(functools.partial(target_score, cfg=cfg), donate_argnums=(1,), name="verify")
    acc = runtime.Compiled(functools.partial(accept_step, needs_filter=needs_filter), name="sample")
    return score, acc


def generate_sd(model, prompts, ids, sampling, spec, on_text, load) -> GenerationResult:
    from ssd_jax.drafters.model import ModelDrafter

    drafter = make_drafter(spec, model, sampling, load)  # two meshes: decoding.sd_two_mesh
    # the draft's context window must hold the batch too
    batch = Batch.build(
        model,
        prompts,
        ids,
        sampling,
        spec,
        also_fits=(drafter.model,) if isinstance(drafter, ModelDrafter) else (),
    )
    rows, B, K, tokens, n_valid, max_len = (
        batch.rows,
        batch.size,
        spec.k,
        batch.tokens,
        batch.n_valid,
        batch.max_len,
    )
    put = functools.partial(_put, model)
    rs = jax.tree.map(put, RowSampling.broadcast(sampling, B))
    key = seed_key(sampling.seed, put)
    kdraft, kverify = jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)
    prefill, _ = runtime.ar_steps(model.cfg, sampling.needs_filter)
    score, acc = sd_steps(model.cfg, sampling.needs_filter)

    # --- compile everything up front (timed), then prefill target and draft
    cache = _cache_for(model, B, max_len)
    tokens_d, n_valid_d = put(tokens), put(n_valid)
    compile_s = prefill.precompile(model.params, cache, tokens_d, n_valid_d, key, rs)
    compile_s += drafter.start(tokens, n_valid, max_len, put)
    if spec.profile_stages:
        zB = put(np.zeros((B,), np.int32))
        compile_s += drafter.precompile(zB, zB, kdraft, rs)
        zK = put(np.zeros((B, K), np.int32))
        compile_s += score.precompile(model.params, cache, zB, zK)
        V = model.cfg.vocab_size
        q_spec = None if drafter.kind != "model" else put(np.zeros((B, K, V), np.float32))
        step0 = put(np.int32(0))
        logit_spec = put(np.zeros((B, K + 1, V), np.float32))
        compile_s += acc.precompile(kverify, step0, logit_spec, zK, zB, q_spec, rs, zB, zB)
        if getattr(drafter, "needs_history", False):  # host-drafted rounds with no proposal (host_width)
            z0 = put(np.zeros((B, 0), np.int32))
            compile_s += score.precompile(model.params, cache, zB, z0)
            compile_s += acc.precompile(
                kverify, step0, put(np.zeros((B, 1, V), np.float32)), z0, zB, None, rs, zB, zB
            )

    if not spec.profile_stages:
        return _generate_fused(
            model,
            batch,
            drafter,
            sampling,
            spec,
            cache,
            tokens_d,
            n_valid_d,
            key,
            rs,
            on_text,
            compile_s,
            put,
        )

    t0 = time.perf_counter()
    cur, cache = prefill(model.params, cache, tokens_d, n_valid_d, key, rs)
    drafter.prefill()  # queued behind the target's prefill; both count towards ttft
    prev = put(batch.last_prompt_tokens())
    first = np.asarray(cur)
    jax.block_until_ready(getattr(drafter, "cache", None))  # else the first round's draft time absorbs it
    ttft = time.perf_counter() - t0
    batch.push_first(first, on_text)
    history = batch.histories(first) if getattr(drafter, "needs_history", False) else None

    t_draft = t_verify = t_sample = 0.0
    empty = 0  # host-drafted rounds with no proposal in any live row (one target step each)
    stats = AcceptanceStats(B, K)
    live = np.array([not r.done for r in rows])
    step = 0
    while live.any():
        step += 1
        a = time.perf_counter()
        prop = drafter.propose(prev, cur, jax.random.fold_in(kdraft, step), rs, history)
        jax.block_until_ready(prop.tokens)
        toks = prop.tokens
        if history is not None and host_width(np.asarray(prop.n_draft), live, K) == 0:
            toks, empty = put(np.zeros((B, 0), np.int32)), empty + 1
        b_ = time.perf_counter()
        logits, cache = score(model.params, cache, cur, toks)
        logits.block_until_ready()
        c = time.perf_counter()
        emitted, n_acc, lengths, draft_lengths, prev, cur = acc(
            kverify, put(np.int32(step)), logits, toks, prop.n_draft, prop.q, rs, cache.lengths, cur
        )
        emitted_h, n_acc_h, n_draft_h = np.asarray(emitted), np.asarray(n_acc), np.asarray(prop.n_draft)
        d = time.perf_counter()
        t_draft, t_verify, t_sample = t_draft + (b_ - a), t_verify + (c - b_), t_sample + (d - c)
        cache = cache.with_lengths(lengths)
        # only live rows matter: a stopped row's draft cache may go stale, its output is final
        drafter.commit(draft_lengths, all_accepted=bool((n_acc_h >= n_draft_h)[live].any()))

        stats.update(live, n_acc_h, n_draft_h)
        push_round(rows, live, emitted_h, n_acc_h, on_text, history)
    wall = time.perf_counter() - t0

    stages = {
        "draft_s": t_draft,
        "verify_s": t_verify,
        "sample_s": t_sample,
        "overhead_s": max(0.0, wall - ttft - t_draft - t_verify - t_sample),
        "rounds_without_proposals": empty,
    }
    return sd_result(batch, stats, drafter, K, step, wall, ttft, compile_s, stages)


def sd_result(batch, stats, drafter, K, rounds, wall, ttft, compile_s, extra) -> GenerationResult:
    """Outputs and metrics of an SD run (both loops)."""
    metrics = {
        **batch.speed_metrics(wall, ttft, compile_s),
        "k": K,
        "draft": drafter.kind if drafter.kind != "model" else drafter.model.name,
        "verify_steps": rounds,
        **stats.metrics(),
        **extra,
        "prefill_s": ttft,
    }
    return GenerationResult(batch.outputs(stats.row_metrics), metrics, method="sd")


def _generate_fused(
    model, batch, drafter, sampling, spec, cache, tokens_d, n_valid_d, key, rs, on_text, compile_s, put
) -> GenerationResult:
    """The default SD loop: one compiled call per round (:func:`sd_round`). For on-device drafters
    round T+1 is queued before round T's tokens are read, so the host's EOS / stop checks and
    bookkeeping overlap the device's next round; the n-gram drafter needs round T's tokens for
    its lookup, so its rounds alternate with the host."""
    rows, B, K = batch.rows, batch.size, spec.k
    prefill, _ = runtime.ar_steps(model.cfg, sampling.needs_filter)
    kind = {"model": "model", "random": "random"}.get(drafter.kind, "host")
    dparams = drafter.model.params if kind == "model" else None
    dcfg = drafter.model.cfg if kind == "model" else None
    rand_vocab = getattr(drafter, "vocab", model.cfg.vocab_size)
    greedy = sampling.temperature == 0  # the whole batch: the argmax-only round (same tokens, less work)
    # K adaptive (spec.k_plan, from k="auto"): one program per candidate K, all compiled now
    plan = spec.k_plan if kind != "random" else None
    sched = OnlineK(plan, K) if plan is not None else None
    widths = sorted({K, *(plan.ks if plan is not None else ())} | ({0} if kind == "host" else set()))
    zB, step1, false = put(np.zeros((B,), np.int32)), put(np.int32(1)), put(np.bool_(False))
    zK = {w: put(np.zeros((B, w), np.int32)) for w in widths}
    progs = {}
    for w in widths:  # host drafts: rounds where no row has a proposal run the 0-column program
        progs[w] = sd_round_program(
            model.cfg, dcfg, w, model.cfg.vocab_size, rand_vocab, sampling.needs_filter, kind, greedy
        )
        compile_s += progs[w].precompile(
            model.params,
            cache,
            dparams,
            drafter.cache if kind == "model" else None,
            zB,
            zB,
            false,
            step1,
            key,
            rs,
            zK[w],
            zB,
        )

    empty = [0]

    def host_round(tc, dc, cur_, prev_, catch_, step_, toks, n_h, k):
        w = host_width(n_h, live, k)
        empty[0] += w == 0
        return progs[w](
            model.params, tc, dparams, dc, cur_, prev_, catch_, step_, key, rs, put(toks[:, :w]), put(n_h)
        )

    t0 = time.perf_counter()
    cur, cache = prefill(model.params, cache, tokens_d, n_valid_d, key, rs)
    drafter.prefill()  # queued behind the target's prefill; both count towards ttft
    dcache = drafter.cache if kind == "model" else None
    prev = put(batch.last_prompt_tokens())
    first = np.asarray(cur)
    jax.block_until_ready(
        dcache
    )  # the draft's prefill ends before decode time starts (else round 1 absorbs it)
    ttft = time.perf_counter() - t0
    batch.push_first(first, on_text)
    history = batch.histories(first) if kind == "host" else None

    def host_proposals(k):
        return ngram_proposals(history, k, drafter.n_min, drafter.n_max, rows=np.flatnonzero(live))

    def next_k():
        return sched.k if sched is not None else K

    stats = AcceptanceStats(B, max(widths))
    live = np.array([not r.done for r in rows])
    max_rounds = sampling.max_new_tokens  # every live row emits at least one token per round
    state = (cache, dcache, cur, prev, false, step1)
    ks = collections.deque([next_k()])  # the K of each round dispatched and not read yet
    if kind == "host":
        toks, n_draft_h = host_proposals(ks[0])
        out = host_round(*state, toks, n_draft_h, ks[0])
    else:
        out = progs[ks[0]](model.params, state[0], dparams, state[1], *state[2:], key, rs, zK[ks[0]], zB)
    dispatched = 1
    step = 0
    nxt = None
    while live.any():
        step += 1
        emitted_d, _, tcache, dcache_o, cur_o, prev_o, catch_o, step_o = out
        if kind != "host" and dispatched < max_rounds:  # queue round T+1 before reading round T (its K
            k1 = next_k()  # then comes from rounds up to T-1)
            nxt = progs[k1](
                model.params, tcache, dparams, dcache_o, cur_o, prev_o, catch_o, step_o, key, rs, zK[k1], zB
            )
            ks.append(k1)
            dispatched += 1
        else:
            nxt = None
        host = np.asarray(emitted_d)  # the round's one read: tokens and accepted counts
        emitted_h, n_acc_h = host[:, :-1], host[:, -1]
        k_read = ks.popleft()
        if kind != "host":
            n_draft_h = np.full(B, k_read, np.int32)
        stats.update(live, n_acc_h, n_draft_h)
        if sched is not None:
            sched.update(k_read, live, n_acc_h, n_draft_h)
        push_round(rows, live, emitted_h, n_acc_h, on_text, history)
        if not live.any():
            break
        if kind == "host":
            ks.append(next_k())
            toks, n_draft_h = host_proposals(ks[-1])
            nxt = host_round(tcache, dcache_o, cur_o, prev_o, catch_o, step_o, toks, n_draft_h, ks[-1])
        if nxt is None:
            break
        out = nxt
    wall = time.perf_counter() - t0
    if nxt is not None:
        jax.block_until_ready(nxt[0])  # don't leave a round running into the next call's timing

    # one call per round: stage times need profile_stages=True (--profile-stages)
    stages = {
        "draft_s": None,
        "verify_s": None,
        "sample_s": None,
        "overhead_s": None,
        "round_s": wall - ttft,
        "calls_per_round": 1,
        "rounds_without_proposals": empty[0],
        **(sched.metrics() if sched else {}),
    }
    return sd_result(batch, stats, drafter, K, step, wall, ttft, compile_s, stages)
