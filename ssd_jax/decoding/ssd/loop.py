"""The SSD round loop and its metrics.

Both models on one device: one compiled call per round (:func:`.rounds.fused_round`). Separate
meshes: one call on the target mesh (verify + rejection sampling) and two on the draft mesh (the
cache build, dispatched right after the verify so the two overlap, and the lookup once the
outcome has crossed back). A fused draft call (lookup of round T + build of round T+1) would
hold the next speculation back until the build finished, so the target would wait for the
draft every round: the two-call draft side is what lets the meshes overlap. Rounds are queued
one ahead of the host's reads (the fan-out layouts lag a round); the n-gram backup reads the
round's tokens before its lookup. ``--profile-stages`` / ``--trace`` run the stages as separate
calls on a timeline, for stage times and the overlap.

Under ``jax.distributed`` the meshes may belong to different processes. Every process runs this
loop; what crosses each round is the outcome (the round's tokens and counts, target -> draft) and
the next speculation with its meta (draft -> target), each as one collective over both meshes
(:meth:`.Placement.to_draft` / :meth:`.Placement.to_target`), whose replicated result every
process reads, so all host loops take the same decisions. The trace's events are gathered on
process 0, one lane per process and device set.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from ssd_jax.decoding import runtime
from ssd_jax.decoding.batch import Batch, GenerationResult, seed_key
from ssd_jax.decoding.sd import push_round
from ssd_jax.decoding.ssd import fanout as fo
from ssd_jax.decoding.ssd.backup import RunningMeans, backup_cost_estimate, row_schedule
from ssd_jax.decoding.ssd.rounds import META, Control, ssd_programs
from ssd_jax.decoding.ssd.tree import Opts
from ssd_jax.decoding.stats import AcceptanceStats
from ssd_jax.decoding.trace import Timeline, lane_for
from ssd_jax.drafters.base import Proposal, check_same_tokenizer
from ssd_jax.drafters.ngram import ngram_proposals
from ssd_jax.errors import UserError
from ssd_jax.models import llama
from ssd_jax.parallel import distributed as dist
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


def layout_table(est, K: int, M: int, uniform: bool):
    """Fan-out schedules and branch layouts for every row state (see :class:`.rounds.Control`)."""
    sched = np.stack(
        [est.schedule(False)] + [row_schedule(est, True, n, K, M, uniform) for n in range(K + 1)]
    )
    sched = sched.astype(np.int64)
    return (sched, *_branch_layouts(sched.tobytes(), sched.shape, M))


@functools.lru_cache(maxsize=64)
def _branch_layouts(sched_bytes: bytes, shape: tuple, M: int):
    """Branch layouts of a schedule table, cached: the schedules change rarely between rounds."""
    return fo.branch_layout(np.frombuffer(sched_bytes, np.int64).reshape(shape), M)


def fanout_setup(spec, n_draft_devices: int = 1):
    """(uniform?, branches per row M, the fan-out estimator) of a validated SSD spec with an integer K."""
    K = spec.k
    uniform = spec.fan_out != "geometric"
    if uniform:
        F = int(spec.fan_out)
        M = F * (K + 1)
    else:
        # default: two branches per acceptance position, rounded up to fill every draft device
        n_dd = n_draft_devices
        M = spec.fan_out_budget if spec.fan_out_budget is not None else -(-2 * (K + 1) // n_dd) * n_dd
    est = fo.FanoutEstimator(K, M, "uniform" if uniform else "geometric", uniform_F=F if uniform else None)
    return uniform, M, est


def generate_ssd(model, prompts, ids, sampling, spec, on_text, load, trace_path=None) -> GenerationResult:
    # the spec was validated by generate() (SpecConfig._validate_ssd): backup, fan-out, budget, C
    K = spec.k
    n_dd = 1 if spec.target_devices is None and spec.draft_devices is None else (spec.draft_devices or 1)
    uniform, M, est = fanout_setup(spec, n_dd)

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
        k=K,
        budget=M,
        vocab=model.cfg.vocab_size,
        rand_vocab=tok.vocab_size if tok is not None else model.cfg.vocab_size,
        needs_filter=sampling.needs_filter,
        greedy=greedy,
        c=float(spec.saguaro_c),
        tree_base=max_len,
        mesh=None if pl.single else draft.mesh,
    )
    ctl = Control(k=K, budget=M, batch=B)
    prog = ssd_programs(target.cfg, draft.cfg, opts, ctl, sampling.needs_filter, sampling.max_new_tokens)
    prefill, _ = runtime.ar_steps(target.cfg, sampling.needs_filter)
    tput, dput = pl.put_target, pl.put_draft
    # stage timing (and the trace) needs the stages as separate calls: --profile-stages / --trace
    profiled = bool(trace_path) or spec.profile_stages
    fused = pl.single and not profiled

    rs_host = RowSampling.broadcast(sampling, B)
    rs_t, rs_d = jax.tree.map(tput, rs_host), jax.tree.map(dput, rs_host)
    key_t = seed_key(sampling.seed, tput)
    kverify, kdraft = seed_key(sampling.seed, tput, fold=2), seed_key(sampling.seed, dput, fold=1)

    tcache = cache_for(target, B, max_len)
    dcache = llama.init_cache(draft.cfg, B, max_len + M * K)
    dcache = jax.tree.map(dput, dcache)
    tl = Timeline(enabled=profiled)
    tlane, dlane = _lane(pl.target_devices), _lane(pl.draft_devices)
    hlane = f"host p{jax.process_index()}" if dist.multi_process() else "host"
    if profiled and dist.multi_process():
        dist.sync_clock("ssd_trace_origin")  # a common time origin for every process's events
    origin = time.perf_counter()
    kinds = {"neural": ["neural"], "random": ["random"], "ngram": ["host"], "auto": ["neural", "host"]}[
        spec.backup
    ]
    first_kind = "random" if spec.backup == "random" else "neural"
    live = np.array([not r.done for r in rows])
    sched, kb_tab, rb_tab = layout_table(est, K, M, uniform)
    ctrl0 = ctl.pack(kb_tab, rb_tab, est.schedule(False)[:K], live)

    # --- compile everything up front
    tok_d, nval_d = tput(tokens), tput(n_valid)
    compile_s = prefill.precompile(target.params, tcache, tok_d, nval_d, key_t, rs_t)
    dtok, dnval = dput(tokens), dput(n_valid)
    compile_s += prog["draft_prefill"].precompile(draft.params, dcache, dtok, dnval)
    zB_d = dput(np.zeros(B, np.int32))
    ctrl_d = dput(ctrl0)
    step_t, step_d = tput(np.int32(1)), dput(np.int32(1))
    zK_d = dput(np.zeros((B, K), np.int32))
    a = time.perf_counter()
    n_compiles = prog[f"first_{first_kind}"].compiles + prog["build"].compiles
    sp0, pm0, dcache = prog[f"first_{first_kind}"](draft.params, dcache, zB_d, kdraft, rs_d, ctrl_d)
    # one real build on the empty cache (its writes are overwritten by the prefill) gives a tree
    # with the exact shardings the loop will pass to advance
    tree0, dcache = prog["build"](draft.params, dcache, zB_d, sp0, pm0, step_d, kdraft, rs_d, ctrl_d)
    jax.block_until_ready(tree0)
    if (
        prog[f"first_{first_kind}"].compiles + prog["build"].compiles > n_compiles
    ):  # else: no compile happened
        compile_s += time.perf_counter() - a
    spec_t0 = _to_target(sp0, pl)
    zB_t = tput(np.zeros(B, np.int32))
    if profiled:
        compile_s += prog["score"].precompile(target.params, tcache, zB_t, spec_t0.tokens)
        logit0 = tput(np.zeros((B, K + 1, model.cfg.vocab_size), np.float32))
        compile_s += prog["sample"].precompile(kverify, step_t, logit0, spec_t0, rs_t, zB_t, zB_t)
    else:
        compile_s += prog["verify"].precompile(target.params, tcache, zB_t, spec_t0, step_t, kverify, rs_t)
    outcome0 = dput(np.zeros((B, 3), np.int32))
    for kind in kinds:
        if fused and kind != "host":
            compile_s += prog[f"round_{kind}"].precompile(
                target.params,
                tcache,
                draft.params,
                dcache,
                zB_t,
                sp0,
                pm0,
                nval_d,
                step_t,
                kverify,
                kdraft,
                rs_t,
                ctrl_d,
            )
        else:
            compile_s += prog[f"advance_{kind}"].precompile(
                draft.params, tree0, dcache, outcome0, dnval, step_d, kdraft, rs_d, ctrl_d, zK_d, zB_d
            )
    if pl.bridge is not None:  # the loop's moves between processes are collectives: compile them now
        a, n_moves = time.perf_counter(), pl.bridge.compiles
        zi = np.zeros((B, K + 2), np.int32)
        jax.block_until_ready(
            [
                pl.to_draft(zB_t),
                pl.to_draft((tput(zi[:, :3]), tput(zi))),
                pl.to_target((_spec_only(sp0), dput(zi[:, :META]))),
            ]
        )
        if pl.bridge.compiles > n_moves:  # else: compiled by an earlier run of this process
            compile_s += time.perf_counter() - a
    del tree0, sp0, pm0, spec_t0

    # --- prefill both models (both count towards ttft), then the first speculation
    t0 = time.perf_counter()
    cur_t, tcache = prefill(target.params, tcache, tok_d, nval_d, key_t, rs_t)
    tl.record("prefill", tlane, cur_t, round=0)
    dcache = prog["draft_prefill"](draft.params, dcache, dtok, dnval)
    tl.record("draft_prefill", dlane, dcache.lengths, round=0)
    if pl.single:
        first = np.asarray(cur_t)
        cur_d = dput(first)
    else:
        cur_d, cur_all = pl.to_draft(cur_t)
        first = pl.read(cur_all)
    jax.block_until_ready(dcache)  # the draft's prefill ends before decode time starts
    ttft = time.perf_counter() - t0
    batch.push_first(first, on_text)
    sp, pm, dcache = prog[f"first_{first_kind}"](draft.params, dcache, cur_d, kdraft, rs_d, ctrl_d)
    tl.record(f"fallback_{first_kind}", dlane, sp.tokens, round=0)
    history = batch.histories(first) if "host" in kinds else None
    state = {
        "tcache": tcache,
        "dcache": dcache,
        "cur_t": cur_t,
        "cur_d": cur_d,
        "sp": sp,
        "pm": pm,
        "step_t": step_t,
        "step_d": step_d,
        "sp_t": _to_target(sp, pl),
    }

    stats = AcceptanceStats(B, K)
    # the speculation verified next: where it came from (hit, fast fallback) and its length
    meta_next = np.zeros((B, META), np.int64)
    meta_next[:, 1] = first_kind != "neural"
    meta_next[:, 2] = K
    meta_next[:, 3] = live
    fallback_calls = {
        "neural": 1 if first_kind == "neural" else 0,
        "ngram": 0,
        "random": int(first_kind == "random"),
    }
    hits = np.zeros(B, np.int64)
    lookups = np.zeros(B, np.int64)
    tau = {"hit": [0, 0], "miss": [0, 0]}  # tokens, rounds
    # the backup decision's inputs: token statistics of this run (running means with a prior) and
    # stage costs estimated once from the model shapes, never from clocks (seeded runs reproduce)
    means = RunningMeans(p_hit=0.6, e_hit=1 + 0.7 * K, e_neural=1 + 0.7 * K, e_fast=1.2)
    costs = backup_cost_estimate(
        target.cfg,
        draft.cfg,
        batch=B,
        k=K,
        budget=M,
        draft_devices=len(pl.draft_devices),
        context=max(n_valid) + sampling.max_new_tokens / 2,
        device=pl.draft_devices[0],
    )
    b_star = None
    batch_all_hit = [0, 0]
    calls = [0]

    def choose_kind() -> str:
        nonlocal b_star
        if spec.backup != "auto":
            return kinds[0]
        b_star = fo.critical_batch_size(
            means["p_hit"],
            means["e_hit"],
            means["e_neural"],
            means["e_fast"],
            costs["t_primary"],
            costs["t_neural"],
            costs["t_fast"],
        )
        return "neural" if int(live.sum()) < b_star else "host"

    def dispatch(step: int, kind: str) -> dict:
        """Queue round ``step`` on the devices; a host-backup round reads its tokens mid-way (n-gram lookups)."""
        st = state
        ctrl = dput(ctl.pack(kb_tab, rb_tab, est.schedule(False)[:K], live))
        rnd = {"step": step, "kind": kind, "sched": sched, "processed": False}
        if fused and kind != "host":
            out, st["sp"], st["pm"], st["tcache"], st["dcache"], cur, st["step_t"] = prog[f"round_{kind}"](
                target.params,
                st["tcache"],
                draft.params,
                st["dcache"],
                st["cur_t"],
                st["sp"],
                st["pm"],
                nval_d,
                st["step_t"],
                kverify,
                kdraft,
                rs_t,
                ctrl,
            )
            st["cur_t"] = st["cur_d"] = cur
            st["step_d"] = st["step_t"]
            rnd["out"] = out
            calls[0] += 1
            return rnd
        spec_t = st["sp_t"]
        if profiled:
            logits, st["tcache"] = prog["score"](target.params, st["tcache"], st["cur_t"], spec_t.tokens)
            tl.record("verify", tlane, logits, round=step)
        else:
            out, outcome, cur_t, st["tcache"], st["step_t"] = prog["verify"](
                target.params, st["tcache"], st["cur_t"], spec_t, st["step_t"], kverify, rs_t
            )
            tl.record("verify", tlane, out, round=step)
        # draft: build the cache for the next round while the target verifies
        tree, st["dcache"] = prog["build"](
            draft.params, st["dcache"], st["cur_d"], st["sp"], st["pm"], st["step_d"], kdraft, rs_d, ctrl
        )
        tl.record("build", dlane, tree.tokens, round=step)
        if profiled:
            out, outcome, cur_t, new_len, st["step_t"] = prog["sample"](
                kverify, st["step_t"], logits, spec_t, rs_t, st["tcache"].lengths, st["cur_t"]
            )
            st["tcache"] = st["tcache"].with_lengths(new_len)
            tl.record("sample", tlane, cur_t, round=step)
        st["cur_t"] = cur_t
        # only the outcome crosses back: (k, bonus, new length) per row, with the round's tokens
        if pl.single:
            rnd["out"] = out
        else:
            (outcome, _), (_, rnd["out"]) = pl.to_draft((outcome, out))
        host_tok, host_n = zK_d, zB_d
        if kind == "host":  # n-gram lookups need this round's tokens: read them now
            process(rnd, None)
            a = time.perf_counter()
            ng, ng_n = ngram_proposals(
                history, K, spec.prompt_lookup_min, spec.prompt_lookup_max, rows=np.flatnonzero(live)
            )
            host_tok, host_n = dput(ng), dput(ng_n.astype(np.int32))
            tl.mark("ngram", hlane, round=step, start=a, end=time.perf_counter())
        st["sp"], st["pm"], meta, st["dcache"], st["cur_d"], st["step_d"] = prog[f"advance_{kind}"](
            draft.params,
            tree,
            st["dcache"],
            outcome,
            dnval,
            st["step_d"],
            kdraft,
            rs_d,
            ctrl,
            host_tok,
            host_n,
        )
        tl.record("advance", dlane, st["sp"].tokens, round=step)
        # the next speculation crosses to the target right away, with the meta every host reads
        if pl.bridge is None:
            st["sp_t"], rnd["meta"] = _to_target(st["sp"], pl), meta
        else:
            (st["sp_t"], _), (_, rnd["meta"]) = pl.to_target((_spec_only(st["sp"]), meta))
        calls[0] += 3 + profiled
        return rnd

    def process(rnd: dict, meta_h) -> None:
        """The round's host work: its tokens to the rows (EOS / stop / length), statistics."""
        nonlocal meta_next
        if not rnd["processed"]:
            out_h = pl.read(rnd["out"])
            rnd["processed"] = True
            rnd["n_acc"] = out_h[:, K + 1]
            meta_cur = meta_next
            stats.update(live, rnd["n_acc"], meta_cur[:, 2], hit=meta_cur[:, 0] > 0)
            rnd["live"], rnd["meta_cur"] = live.copy(), meta_cur
            push_round(rows, live, out_h[:, : K + 1], rnd["n_acc"], on_text, history)
            if "meta" not in rnd:  # fused: the meta columns follow the tokens
                rnd["meta"] = out_h[:, K + 2 :]
        if meta_h is None:
            return
        # the lookup that produced the next speculation, over the rows live in this round
        lv, meta_cur, n_acc = rnd["live"], rnd["meta_cur"], rnd["n_acc"]
        hit_h, miss_dev = meta_h[:, 0] > 0, (meta_h[:, 0] == 0) & (meta_h[:, 3] > 0)
        from_cache, post_miss, n_draft_h = meta_cur[:, 0] > 0, meta_cur[:, 1] > 0, meta_cur[:, 2]
        emitted_n = n_acc + 1
        for name, sel in (("hit", from_cache & lv), ("miss", ~from_cache & lv)):
            tau[name][0] += int(emitted_n[sel].sum())
            tau[name][1] += int(sel.sum())
        if (from_cache & lv).any():
            means.add("e_hit", float(emitted_n[from_cache & lv].mean()))
        neural_rows = ~from_cache & ~post_miss & lv
        if neural_rows.any():
            means.add("e_neural", float(emitted_n[neural_rows].mean()))
        if (post_miss & lv).any():
            means.add("e_fast", float(emitted_n[post_miss & lv].mean()))
        fan_rows = rnd["sched"][np.where(post_miss, 1 + n_draft_h, 0)]
        est.observe(n_acc[lv], n_draft_h[lv], hit_h[lv], fan_rows[lv], post_miss[lv])
        batch_all_hit[0] += int(hit_h[lv].all())
        batch_all_hit[1] += 1
        means.add("p_hit", float(hit_h[lv].mean()), n=float(lv.sum()) / max(B, 1))
        # the hit rate counts the lookups whose speculation is verified next (rows still live)
        hits[:] += hit_h & live
        lookups[:] += live
        if miss_dev.any():  # a fallback ran on the device
            fallback_calls[{"host": "ngram"}.get(rnd["kind"], rnd["kind"])] += 1
        meta_next = meta_h.astype(np.int64)

    max_rounds = sampling.max_new_tokens  # every live row emits at least one token per round
    step = 1
    pending = dispatch(step, choose_kind())
    while True:
        rnd, pending = pending, None
        kind = choose_kind()
        if kind != "host" and step < max_rounds:
            step += 1
            pending = dispatch(step, kind)  # queue round T+1 before reading round T
        process(rnd, None)
        process(rnd, pl.read(rnd["meta"]))
        if not live.any():
            break
        if pending is None:
            step += 1
            pending = dispatch(step, choose_kind())
        sched, kb_tab, rb_tab = layout_table(est, K, M, uniform)
    wall = time.perf_counter() - t0
    rounds_done = stats.n_rounds
    if pending is not None:  # a queued round past the end: don't let it run into the caller's timing
        jax.block_until_ready(pending["out"])
    jax.block_until_ready(state["sp"].tokens)
    tl.close()
    if profiled and dist.multi_process():  # every process's lanes, on process 0
        tl = _merged(tl, origin)
    if trace_path and dist.is_main():
        tl.write_chrome(trace_path)
    stages = (
        _stage_metrics(tl, wall, ttft)
        if profiled and tl is not None
        else dict.fromkeys(
            ("draft_s", "draft_exposed_s", "verify_s", "sample_s", "overhead_s", "overlap_fraction")
        )
    )
    outputs = batch.outputs(
        lambda b: {
            **stats.row_metrics(b),
            "cache_hit_rate": float(hits[b] / lookups[b]) if lookups[b] else 0.0,
        }
    )
    metrics = {
        **batch.speed_metrics(wall, ttft, compile_s),
        "k": K,
        "draft": draft.name,
        "verify_steps": rounds_done,
        **stats.metrics(),
        "cache_hit_rate": float(hits.sum() / lookups.sum()) if lookups.sum() else 0.0,
        "batch_cache_hit_rate": batch_all_hit[0] / batch_all_hit[1] if batch_all_hit[1] else 0.0,
        "tau_hit": tau["hit"][0] / tau["hit"][1] if tau["hit"][1] else 0.0,
        "tau_miss": tau["miss"][0] / tau["miss"][1] if tau["miss"][1] else 0.0,
        "fanout": {
            "mode": "uniform" if uniform else "geometric",
            "budget": M,
            "schedule": est.schedule(False).tolist(),
            "post_miss_schedule": est.schedule(True).tolist(),
            **est.to_dict(),
        },
        "saguaro_c": float(spec.saguaro_c),
        "backup": spec.backup,
        "b_star": b_star,
        "backup_model": costs,
        "fallback_calls": fallback_calls,
        **stages,
        "round_s": wall - ttft,
        "calls_per_round": calls[0] / max(1, step),
        "prefill_s": ttft,
        "devices": {
            "single_device": pl.single,
            "target": len(pl.target_devices),
            "draft": len(pl.draft_devices),
            "processes": jax.process_count(),
            "target_processes": sorted({d.process_index for d in pl.target_devices}),
            "draft_processes": sorted({d.process_index for d in pl.draft_devices}),
        },
    }
    return GenerationResult(outputs, metrics, method="ssd")


def _spec_only(sp: Proposal) -> Proposal:
    return Proposal(sp.tokens, sp.n_draft, sp.q)


def _to_target(sp: Proposal, pl) -> Proposal:
    """What the target needs of a speculation (tokens, counts, q), on the target mesh."""
    if pl.single:
        return _spec_only(sp)
    return pl.to_target(_spec_only(sp))[0]


def _lane(devices) -> str:
    """A trace lane per device set, named with its process(es) when there are several."""
    lane = lane_for(devices)
    if dist.multi_process():
        procs = ",".join(str(p) for p in sorted({d.process_index for d in devices}))
        lane = f"process {procs} {lane}"
    return lane


def _merged(tl: Timeline, origin: float) -> Timeline | None:
    """A timeline of every process's events (times from the common origin), on process 0; None elsewhere."""
    mine = [
        dict(e, start=e["start"] - origin, end=e["end"] - origin, dispatch=e["dispatch"] - origin)
        for e in tl.events()
    ]
    every = dist.gather_to_main(mine)
    if every is None:
        return None
    out = Timeline(enabled=True)
    out.add_events([e for evs in every for e in evs])
    return out


def _stage_metrics(tl, wall: float, ttft: float) -> dict:
    """Stage times from the timeline (profiled runs: --profile-stages or --trace)."""
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
    return {
        "draft_s": draft_s,
        "draft_exposed_s": exposed,
        "verify_s": verify_s,
        "sample_s": sample_s,
        "overhead_s": max(0.0, wall - ttft - verify_s - sample_s - exposed),
        "overlap_fraction": tl.overlap_fraction("verify", "build"),
    }
