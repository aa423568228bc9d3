"""The SSD round loop: verify on the target mesh, cache build on the draft mesh dispatched without
waiting, only the outcome crossing back, one blocking read per round; and its metrics.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from ssd_jax.decoding import runtime
from ssd_jax.decoding.batch import Batch, GenerationResult, seed_key
from ssd_jax.decoding.sd import push_round, sd_steps
from ssd_jax.decoding.ssd import fanout as fo
from ssd_jax.decoding.ssd.backup import RunningMeans, backup_cost_estimate, row_schedule
from ssd_jax.decoding.ssd.tree import Opts, ssd_programs
from ssd_jax.decoding.stats import AcceptanceStats
from ssd_jax.decoding.trace import Timeline, lane_for
from ssd_jax.drafters.base import Proposal, check_same_tokenizer
from ssd_jax.drafters.ngram import ngram_proposals
from ssd_jax.errors import UserError
from ssd_jax.models import llama
from ssd_jax.parallel.placement import cache_for, place
from ssd_jax.sampling.filters import RowSampling


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]



def _measure(iv) -> float:
    return sum(b - a for a, b in iv)



def _intersection(x, y) -> float:
    """Total length of the intersection of two disjoint, sorted interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        tot += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot



def generate_ssd(model, prompts, ids, sampling, spec, on_text, load, trace_path=None) -> GenerationResult:
    # the spec was validated by generate() (SpecConfig._validate_ssd): backup, fan-out, budget, C
    K = spec.k
    uniform = spec.fan_out != "geometric"
    if uniform:
        F = int(spec.fan_out)
        M = F * (K + 1)
    else:
        # default: two branches per acceptance position, rounded up to fill every draft device
        n_dd = 1 if spec.target_devices is None and spec.draft_devices is None else (spec.draft_devices or 1)
        M = spec.fan_out_budget if spec.fan_out_budget is not None else -(-2 * (K + 1) // n_dd) * n_dd

    draft = load(spec.draft) if isinstance(spec.draft, str) else spec.draft
    check_same_tokenizer(model, draft)
    batch = Batch.build(model, prompts, ids, sampling, spec, also_fits=(draft,))
    rows, B, tokens, n_valid, max_len = batch.rows, batch.size, batch.tokens, batch.n_valid, batch.max_len
    pl = place(model, draft, spec)
    target, draft = pl.target, pl.draft
    if M % len(pl.draft_devices) and not pl.single:
        raise UserError(
            f"the fan-out budget ({M} branches) must divide over the {len(pl.draft_devices)} draft devices"
        )
    greedy = sampling.temperature == 0
    tok = model.tokenizer
    opts = Opts(
        k=K, budget=M, vocab=model.cfg.vocab_size,
        rand_vocab=tok.vocab_size if tok is not None else model.cfg.vocab_size,
        needs_filter=sampling.needs_filter, greedy=greedy, c=float(spec.saguaro_c), tree_base=max_len,
        mesh=None if pl.single else draft.mesh,
    )
    prog = ssd_programs(draft.cfg, opts)
    prefill, _ = runtime.ar_steps(target.cfg, sampling.needs_filter)
    score, acc = sd_steps(target.cfg, sampling.needs_filter)
    tput, dput = pl.put_target, pl.put_draft

    rs_host = RowSampling.broadcast(sampling, B)
    rs_t, rs_d = jax.tree.map(tput, rs_host), jax.tree.map(dput, rs_host)
    key_t, key_d = seed_key(sampling.seed, tput), seed_key(sampling.seed, dput)
    kverify, kdraft = jax.random.fold_in(key_t, 2), jax.random.fold_in(key_d, 1)

    tcache = cache_for(target, B, max_len)
    dcache = llama.init_cache(draft.cfg, B, max_len + M * K)
    dcache = jax.tree.map(dput, dcache)
    est = fo.FanoutEstimator(K, M, "uniform" if uniform else "geometric", uniform_F=F if uniform else None)
    tl = Timeline(enabled=True)
    tlane, dlane = lane_for(pl.target_devices), lane_for(pl.draft_devices)

    # --- compile everything up front
    tok_d, nval_d = tput(tokens), tput(n_valid)
    compile_s = prefill.precompile(target.params, tcache, tok_d, nval_d, key_t, rs_t)
    dtok, dnval = dput(tokens), dput(n_valid)
    compile_s += prog["prefill"].precompile(draft.params, dcache, dtok, dnval)
    zB_t, zB_d = tput(np.zeros(B, np.int32)), dput(np.zeros(B, np.int32))
    zK_t, zK_d = tput(np.zeros((B, K), np.int32)), dput(np.zeros((B, K), np.int32))
    fan0 = dput(np.ones((B, K), np.int32))
    kbM = dput(np.zeros((B, M), np.int32))
    bool_d = dput(np.zeros(B, bool))
    V = model.cfg.vocab_size
    q_t = None if greedy else tput(np.zeros((B, K, V), np.float32))
    step_t = tput(np.int32(0))
    compile_s += score.precompile(target.params, tcache, zB_t, zK_t)
    compile_s += acc.precompile(kverify, step_t, tput(np.zeros((B, K + 1, V), np.float32)), zK_t, zB_t, q_t, rs_t,
                                zB_t, zB_t)
    # one real build on the empty cache (its writes are overwritten by the prefill) gives a tree
    # with the exact shardings the loop will pass to advance
    a = time.perf_counter()
    tree0, dcache = prog["build"](draft.params, dcache, zB_d, zK_d, zB_d, kbM, kbM, fan0, kdraft, rs_d)
    jax.block_until_ready(tree0)
    compile_s += time.perf_counter() - a
    kinds = {"neural": ["neural"], "random": ["random"], "ngram": ["host"], "auto": ["neural", "host"]}[spec.backup]
    for kind in kinds:
        compile_s += prog[f"advance_{kind}"].precompile(draft.params, tree0, dcache, zB_d, zB_d, zB_d, bool_d, kdraft,
                                                        rs_d, fan0)
    first_kind = "random" if spec.backup == "random" else "neural"
    compile_s += prog[f"first_{first_kind}"].precompile(draft.params, dcache, zB_d, kdraft, rs_d, fan0)
    if "host" in kinds:
        spec0 = Proposal(zK_d, zB_d, None if greedy else dput(np.zeros((B, K, V), np.float32)), bool_d)
        compile_s += prog["merge"].precompile(spec0, bool_d, zK_d, zB_d)
    del tree0

    # --- prefill both models (both count towards ttft), then the first speculation
    t0 = time.perf_counter()
    cur_t, tcache = prefill(target.params, tcache, tok_d, nval_d, key_t, rs_t)
    tl.record("prefill", tlane, cur_t, round=0)
    dcache = prog["prefill"](draft.params, dcache, dtok, dnval)
    tl.record("draft_prefill", dlane, dcache.lengths, round=0)
    first = np.asarray(cur_t)
    ttft = time.perf_counter() - t0
    batch.push_first(first, on_text)
    cur_d = dput(first)
    fan_next = np.broadcast_to(est.schedule(False)[:K], (B, K)).astype(np.int32)
    sp, dcache = prog[f"first_{first_kind}"](draft.params, dcache, cur_d, jax.random.fold_in(kdraft, 0), rs_d,
                                             dput(fan_next))
    tl.record(f"fallback_{first_kind}", dlane, sp.tokens, round=0)
    history = batch.histories(first)

    stats = AcceptanceStats(B, K)
    live = np.array([not r.done for r in rows])
    n_draft_h = np.full(B, K, np.int64)
    post_miss = np.full(B, first_kind != "neural")  # the speculation came from a fast fallback
    from_cache = np.zeros(B, bool)
    fallback_calls = {"neural": 1 if first_kind == "neural" else 0, "ngram": 0, "random": int(first_kind == "random")}
    hits = np.zeros(B, np.int64)
    lookups = np.zeros(B, np.int64)
    tau = {"hit": [0, 0], "miss": [0, 0]}  # tokens, rounds
    # the backup decision's inputs: token statistics of this run (running means with a prior) and
    # stage costs estimated once from the model shapes, never from clocks (seeded runs reproduce)
    means = RunningMeans(p_hit=0.6, e_hit=1 + 0.7 * K, e_neural=1 + 0.7 * K, e_fast=1.2)
    costs = backup_cost_estimate(target.cfg, draft.cfg, batch=B, k=K, budget=M, draft_devices=len(pl.draft_devices),
                                 context=max(n_valid) + sampling.max_new_tokens / 2, device=pl.draft_devices[0])
    b_star = None
    batch_all_hit = [0, 0]
    step = 0
    while live.any():
        step += 1
        fan_rows = np.where(post_miss[:, None], est.schedule(True), est.schedule(False))
        short: dict = {}
        for b in np.flatnonzero(n_draft_h < K):  # n-gram proposals shorter than K: fewer outcomes
            key_b = (bool(post_miss[b]), int(n_draft_h[b]))
            if key_b not in short:
                short[key_b] = row_schedule(est, *key_b, K, M, uniform)
            fan_rows[b] = short[key_b]
        kb, rb = fo.branch_layout(fan_rows, M)
        fan_next = np.broadcast_to(est.schedule(False)[:K], (B, K)).astype(np.int32)
        # target: verify the current speculation (only the speculation crosses to the target)
        spec_t = jax.tree.map(tput, sp) if not pl.single else sp
        logits, tcache = score(target.params, tcache, cur_t, spec_t.tokens)
        tl.record("verify", tlane, logits, round=step)
        # draft: build the cache for the next round while the target verifies
        tree, dcache = prog["build"](draft.params, dcache, cur_d, sp.tokens, sp.n_draft, dput(kb), dput(rb),
                                     dput(fan_next), jax.random.fold_in(kdraft, 2 * step), rs_d)
        tl.record("build", dlane, tree.tokens, round=step)
        emitted, n_acc, new_len, _, _, cur_t = acc(kverify, tput(np.int32(step)), logits, spec_t.tokens,
                                                   spec_t.n_draft, spec_t.q, rs_t, tcache.lengths, cur_t)
        tl.record("sample", tlane, cur_t, round=step)
        tcache = tcache.with_lengths(new_len)
        # only the outcome crosses back: (k, bonus, new length) per row
        n_acc_d, cur_d, len_d = (dput(x) for x in (n_acc, cur_t, new_len))
        n_live = int(live.sum())
        if spec.backup == "auto":
            b_star = fo.critical_batch_size(means["p_hit"], means["e_hit"], means["e_neural"], means["e_fast"],
                                            costs["t_primary"], costs["t_neural"], costs["t_fast"])
            kind = "neural" if n_live < b_star else "host"
        else:
            kind = kinds[0]
        sp, dcache = prog[f"advance_{kind}"](draft.params, tree, dcache, n_acc_d, cur_d, len_d, dput(live),
                                             jax.random.fold_in(kdraft, 2 * step + 1), rs_d, dput(fan_next))
        tl.record("advance", dlane, sp.tokens, round=step)
        # the round's one blocking read: outcome, hits, emitted tokens
        emitted_h, n_acc_h, hit_h = np.asarray(emitted), np.asarray(n_acc), np.asarray(sp.hit)
        # the timeline's waiter threads record end times on their own; nothing here waits for them

        # statistics over the live rows of this round
        stats.update(live, n_acc_h, n_draft_h, hit=from_cache)
        emitted_n = n_acc_h + 1
        for name, sel in (("hit", from_cache & live), ("miss", ~from_cache & live)):
            tau[name][0] += int(emitted_n[sel].sum())
            tau[name][1] += int(sel.sum())
        if (from_cache & live).any():
            means.add("e_hit", float(emitted_n[from_cache & live].mean()))
        neural_rows = ~from_cache & ~post_miss & live
        if neural_rows.any():
            means.add("e_neural", float(emitted_n[neural_rows].mean()))
        if (post_miss & live).any():
            means.add("e_fast", float(emitted_n[post_miss & live].mean()))
        est.observe(n_acc_h[live], n_draft_h[live], hit_h[live], fan_rows[live], post_miss[live])
        batch_all_hit[0] += int(hit_h[live].all())
        batch_all_hit[1] += 1
        means.add("p_hit", float(hit_h[live].mean()), n=float(live.sum()) / max(B, 1))

        push_round(rows, live, emitted_h, n_acc_h, on_text, history)
        # the hit rate counts the lookups whose speculation is verified next (rows still live)
        hits += hit_h & live
        lookups += live
        missed = ~hit_h & live
        from_cache = hit_h.copy()
        if not missed.any():
            post_miss[:] = False
            n_draft_h[:] = K
            continue
        if kind == "neural":
            fallback_calls["neural"] += 1
            post_miss[:] = False
            n_draft_h[:] = K
        elif kind == "random":
            fallback_calls["random"] += 1
            post_miss = missed.copy()
            n_draft_h[:] = K
        else:  # n-gram lookups on the host for the rows that missed
            a = time.perf_counter()
            ng, ng_n = ngram_proposals(history, K, spec.prompt_lookup_min, spec.prompt_lookup_max,
                                       rows=np.flatnonzero(missed))
            sp = prog["merge"](sp, dput(missed), dput(ng), dput(ng_n))
            tl.mark("ngram", "host", round=step, start=a, end=time.perf_counter())
            fallback_calls["ngram"] += 1
            post_miss = missed.copy()
            n_draft_h = np.where(missed, ng_n, K)
    wall = time.perf_counter() - t0
    jax.block_until_ready(sp.tokens)
    tl.close()
    if trace_path:
        tl.write_chrome(trace_path)

    events = tl.events()
    dur = {}
    for e in events:
        dur[e["name"]] = dur.get(e["name"], 0.0) + (e["end"] - e["start"])
    # draft time the target waited for: draft work (build, advance, fallbacks) while the target
    # lane was idle; in single-device mode that is all of it, with perfect overlap none of it
    tgt = [(e["start"], e["end"]) for e in events if e["round"] > 0 and e["name"] in ("verify", "sample")]
    drf = [(e["start"], e["end"]) for e in events if e["round"] > 0 and e["name"] not in ("verify", "sample")]
    exposed = _measure(_union(drf)) - _intersection(_union(drf), _union(tgt))
    verify_s, sample_s = dur.get("verify", 0.0), dur.get("sample", 0.0)
    draft_s = sum(v for k_, v in dur.items() if k_ in ("build", "advance") or k_.startswith("fallback"))
    outputs = batch.outputs(lambda b: {**stats.row_metrics(b),
                                       "cache_hit_rate": float(hits[b] / lookups[b]) if lookups[b] else 0.0})
    metrics = {
        **batch.speed_metrics(wall, ttft, compile_s),
        "k": K,
        "draft": draft.name,
        "verify_steps": step,
        **stats.metrics(),
        "cache_hit_rate": float(hits.sum() / lookups.sum()) if lookups.sum() else 0.0,
        "batch_cache_hit_rate": batch_all_hit[0] / batch_all_hit[1] if batch_all_hit[1] else 0.0,
        "tau_hit": tau["hit"][0] / tau["hit"][1] if tau["hit"][1] else 0.0,
        "tau_miss": tau["miss"][0] / tau["miss"][1] if tau["miss"][1] else 0.0,
        "fanout": {"mode": "uniform" if uniform else "geometric", "budget": M, "schedule": est.schedule(False).tolist(),
                   "post_miss_schedule": est.schedule(True).tolist(), **est.to_dict()},
        "saguaro_c": float(spec.saguaro_c),
        "backup": spec.backup,
        "b_star": b_star,
        "backup_model": costs,
        "fallback_calls": fallback_calls,
        "draft_s": draft_s,
        "draft_exposed_s": exposed,
        "verify_s": verify_s,
        "sample_s": sample_s,
        "overhead_s": max(0.0, wall - ttft - verify_s - sample_s - exposed),
        "overlap_fraction": tl.overlap_fraction("verify", "build"),
        "prefill_s": ttft,
        "devices": {"single_device": pl.single, "target": len(pl.target_devices), "draft": len(pl.draft_devices)},
    }
    return GenerationResult(outputs, metrics, method="ssd")

