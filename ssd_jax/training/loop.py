"""The training run: :func:`train` (resume, steps, evaluation, saving, best export)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.errors import UserError
from ssd_jax.loading import draft as dfmt
from ssd_jax.models.params import count_params
from ssd_jax.training.args import RESUME_DEFAULTS, RESUME_KEYS, TrainArgs, eval_batch_count
from ssd_jax.training.checkpoint import RunDir, log, tensors_sha256
from ssd_jax.training.corpus import Corpus, build_corpus, eval_batches, train_batch
from ssd_jax.training.draft_model import (
    init_layer_indices,
    init_trained,
    param_report,
    shared_names,
    size_draft,
)
from ssd_jax.training.objective import evaluate, make_eval_step, make_optimizer, make_train_step

#: where ``--keep-evals`` exports the draft of every evaluation (``<run>/evals/<step>/``)
EVALS_DIR = "evals"


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in d.items()}


def _resume_check(meta: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    diffs = []
    if meta["target"].get("weights_sha256") != new["target"]["weights_sha256"]:
        diffs.append(f"target ({meta['target'].get('name')} -> {new['target']['name']})")
    if meta.get("config") != new["config"]:
        diffs.append("draft config (--size)")
    old_args = meta.get("train", {}).get("args", {})
    for k in RESUME_KEYS:
        old_v = old_args.get(k, RESUME_DEFAULTS.get(k))
        if old_v != new["train"]["args"][k]:
            diffs.append(f"--{k.replace('_', '-')} ({old_v} -> {new['train']['args'][k]})")
    old_data = meta.get("train", {}).get("data", {}).get("train", {}).get("sha256")
    if not diffs and old_data and old_data != new["train"]["data"]["train"]["sha256"]:
        diffs.append("training data (the tokenized stream changed)")
    if diffs:
        raise UserError(f"cannot resume {path}: it was trained with a different {', '.join(diffs)}")


def _head_mask(target, n: int, run_path: Path) -> np.ndarray:
    """(V,) bool: the ids a ``--draft-vocab n`` head keeps, from counts stored in the run directory
    (``token_counts.npz``, the file decoding reads next to the draft)."""
    from ssd_jax.drafters.vocab import always_kept, draft_token_counts, kept_ids

    counts = draft_token_counts(target, str(run_path))
    mask = np.zeros((target.cfg.vocab_size,), bool)
    mask[kept_ids(counts, n, always_kept(target.tokenizer))] = True
    return mask


def train(
    args: TrainArgs,
    *,
    corpus: Corpus | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Train (or resume) a draft; returns a summary (out, step, last eval, best, timing).

    ``corpus`` overrides the tokenized data (tests); ``on_step(step, metrics)`` is called
    after every step's log line is written (tests use it to interrupt a run).
    """
    import jax

    from ssd_jax.loading import load_model
    from ssd_jax.loading.store import progress

    args.check()
    args = args.resolved()
    run = RunDir(args.out, args.keep)
    if run.has_run() and not args.resume:
        raise UserError(
            f"{run.path} already holds a training run: pass --resume to continue it or choose another --out"
        )

    # checkpoint layout: drafts are saved and share tensors in it (ssd_jax.loading.draft)
    target = load_model(args.target, dtype=args.dtype, forms="canonical")
    tcfg = target.cfg
    cfg, law = size_draft(tcfg, args.size)
    init_idx = init_layer_indices(args.init_layers, tcfg.num_layers, cfg.num_layers)
    distill = None
    if args.loss == "distill":  # stored target top-k; the held-out evaluation stays on the corpus
        from ssd_jax.training.distill_data import load_distill_data

        distill = load_distill_data(args.data, target.weights_sha256)
        if corpus is None:
            corpus = build_corpus(dataclasses.replace(args, data="corpus", steps=1), target.tokenizer)
        corpus.info = {**corpus.info, "data": args.data, "train": distill.info}
        n_long = int((np.diff(distill.offsets) > args.seq_len + 1).sum())
        if n_long:
            log(
                f"{n_long} of {distill.n} distillation sequences are longer than --seq-len + 1 = {args.seq_len + 1}: "
                f"their prompts lose their start (the target saw the whole prompt)"
            )
    corpus = corpus or build_corpus(args, target.tokenizer)
    shared = shared_names(tcfg)
    frozen = {
        "shared": {n: target.params[n] for n in shared},
        "target": target.params,
    }
    shared_np = {n: np.asarray(target.params[n]) for n in shared}
    pr = param_report(cfg, tcfg)
    meta: dict[str, Any] = {
        "format": dfmt.FORMAT,
        "format_version": dfmt.FORMAT_VERSION,
        "name": run.path.name,
        "target": {
            "name": args.target,
            "path": str(Path(target.source).absolute()) if target.source else None,
            "weights_sha256": target.weights_sha256,
            "params_total": count_params(tcfg),
            "tokenizer_fingerprint": target.tokenizer.fingerprint() if target.tokenizer else None,
        },
        "shared": {"tensors": shared, "sha256": dfmt.shared_sha256(shared_np), "from": "target"},
        "config": cfg.replace(dtype="float32").to_dict(),
        "params": {**pr, "law": law},
        "init": {"layers": init_idx, "final_norm": "target", "mode": args.init_layers},
        "train": {
            "args": {
                k: getattr(args, k)
                for k in (*RESUME_KEYS, "target", "size", "eval_every", "eval_windows", "save_every")
            },
            "data": corpus.info,
            "data_seed": args.seed,
        },
        "step": 0,
        "evals": [],
        "best": None,
    }
    del shared_np

    opt, sched = make_optimizer(args)
    # committed to one device like the arrays orbax restores, so that a fresh and a resumed
    # run in one process share the compiled step
    dev = jax.devices()[0]
    params = jax.device_put(init_trained(target.params, tcfg, cfg, args.init_layers, args.seed), dev)
    opt_state = jax.device_put(opt.init(params), dev)
    start = 0
    run.path.mkdir(parents=True, exist_ok=True)
    if args.resume and run.meta_path.exists():
        old = dfmt.read_meta(run.path)
        _resume_check(old, meta, run.path)
        run.recover_best()
        got = run.restore_latest(params, opt_state)
        if got is not None:
            start, params, opt_state = got
            meta["evals"] = [e for e in old.get("evals", []) if e["step"] <= start]
            if dfmt.is_draft_dir(run.best_dir):
                meta["best"] = dfmt.read_meta(run.best_dir).get("best")
            meta["timing_history"] = old.get("timing_history", [])
            log(f"resuming {run.path} from step {start}")
        else:
            log(f"no complete checkpoint in {run.path}: starting from step 0")
        run.truncate_log(start)
    else:
        if run.log_path.exists():
            run.log_path.unlink()
    dfmt.write_json_atomic(run.meta_path, meta)
    log(
        f"draft: {cfg.num_layers} layers x {cfg.hidden_size} (init from target layers {init_idx}), "
        f"N = {pr['N']:,} trained + {pr['shared']:,} shared; SDSL N_opt = {law['n_opt']:.3g} "
        f"for M = {law['M']:,}; per-token cost {pr['cost_ratio']:.2f}x the target's"
    )

    eval_fn = make_eval_step(cfg, tcfg)
    evb = eval_batches(corpus.heldout, eval_batch_count(args), args.batch_size, args.seq_len)
    if distill is not None:
        from ssd_jax.training.distill import distill_batch, make_distill_step

        if args.draft_vocab is not None:
            mask = _head_mask(target, args.draft_vocab, run.path)
            ids = np.flatnonzero(mask).astype(np.int32)
            col = np.full(mask.shape, -1, np.int32)
            col[ids] = np.arange(ids.size, dtype=np.int32)
            # evaluation masks full-width logits; the train step computes the kept rows only
            frozen.update(jax.device_put({"head_mask": mask, "head_ids": ids, "head_col": col}, dev))
            log(f"head trimmed to {args.draft_vocab} tokens (the ids --draft-vocab {args.draft_vocab} keeps)")
        train_step = make_distill_step(cfg, args.distill_tail, float(args.ce_weight), opt)
        frozen_step = {k: v for k, v in frozen.items() if k != "target"}
        next_batch = lambda step: distill_batch(
            distill, step, args.seed, args.batch_size, args.seq_len, args.pack
        )
    else:
        train_step = make_train_step(cfg, tcfg, args.loss, opt)
        frozen_step = frozen if args.loss != "ce" else {"shared": frozen["shared"], "target": None}
        next_batch = lambda step: train_batch(corpus.train, step, args.seed, args.batch_size, args.seq_len)

    def do_eval(step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        m = evaluate(eval_fn, params, frozen, evb)
        m = {"step": step, **m, "eval_s": time.perf_counter() - t0}
        meta["evals"].append(_finite(m))
        log(
            f"eval step {step}: ppl {m['ppl']:.3f} (target {m['target_ppl']:.3f}), alpha {m['alpha']:.4f}, "
            f"greedy match {m['greedy_match']:.4f}, kl {m['kl']:.4f}  [{m['eval_s']:.1f}s]"
        )
        return m

    def export_best(step: int, m: dict[str, Any]) -> None:
        best = meta.get("best")
        if best is not None and best.get("alpha") is not None and m["alpha"] <= best["alpha"]:
            return
        meta["best"] = {
            "step": step,
            **_finite({k: m[k] for k in ("alpha", "greedy_match", "ppl", "target_ppl", "kl")}),
        }
        bmeta = {**meta, "step": step, "metrics": _finite(m), "params_sha256": tensors_sha256(params)}
        bmeta.pop("evals", None)
        run.export(run.best_dir, params, bmeta)

    def snapshot(
        step: int, m: dict[str, Any]
    ) -> None:  # --keep-evals: the draft at this eval, for learning curves
        if args.keep_evals:
            smeta = {**meta, "step": step, "metrics": _finite(m), "params_sha256": tensors_sha256(params)}
            smeta.pop("evals", None)
            run.export(run.path / EVALS_DIR / str(step), params, smeta)

    due = start == args.steps or (bool(args.eval_every) and start % args.eval_every == 0)
    if due and not any(e["step"] == start for e in meta["evals"]):
        # step 0, or a kill between saving an eval step's state and recording its evaluation
        m0 = do_eval(start)
        export_best(start, m0)
        snapshot(start, m0)
        dfmt.write_json_atomic(run.meta_path, meta)

    tokens_per_step = args.batch_size * args.seq_len
    bar = progress(total=args.steps, initial=start, desc="train", unit="step", leave=True, mininterval=1.0)
    t_first = None
    times: list[float] = []
    loss_tokens = 0.0  # distill: tokens with a loss in the timed steps
    last_eval = meta["evals"][-1] if meta["evals"] else None
    try:
        for step in range(start, args.steps):
            batch = next_batch(step)
            t0 = time.perf_counter()
            params, opt_state, metrics = train_step(params, opt_state, batch, frozen_step)
            metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
            dt = time.perf_counter() - t0
            if t_first is None:
                t_first = dt
            else:
                times.append(dt)
                loss_tokens += metrics.get("tokens", 0.0)
            done = step + 1
            rec = {"step": done, "lr": float(sched(step)), **metrics}
            run.append_log(_finite(rec))
            if not math.isfinite(metrics["loss"]):
                last = dfmt.complete_steps(run.state_dir)
                raise UserError(
                    f"loss became {metrics['loss']} at step {done} (lr {rec['lr']:.3g}); training stopped, "
                    f"the last good checkpoint is step {last[0] if last else 'none'} in {run.path} "
                    f"(lower --lr or --clip and --resume)"
                )
            recent = times[-20:]
            tps = tokens_per_step / (sum(recent) / len(recent)) if recent else float("nan")
            post = f"loss {metrics['loss']:.4f}" + (
                f" a {metrics['alpha']:.3f}" if "alpha" in metrics else ""
            )
            bar.set_postfix_str(f"{post} {tps:,.0f} tok/s", refresh=False)
            bar.update(1)
            is_eval = bool(args.eval_every) and done % args.eval_every == 0
            final = done == args.steps
            if is_eval or final:
                last_eval = do_eval(done)
            if is_eval or final or done % args.save_every == 0:
                run.save(done, params, opt_state)
                meta["step"] = done
                if is_eval or final:
                    export_best(done, last_eval)
                    snapshot(done, last_eval)
                dfmt.write_json_atomic(run.meta_path, meta)
            if on_step is not None:
                on_step(done, rec)
    finally:
        bar.close()
        timing = {
            "first_step_s": t_first,
            "steps": len(times),
            "step_s": (sum(times) / len(times)) if times else None,
            "tokens_per_s": tokens_per_step * len(times) / sum(times) if times else None,
            "loss_tokens_per_s": loss_tokens / sum(times) if times and loss_tokens else None,
            "device": str(jax.devices()[0].platform),
        }
        meta.setdefault("timing_history", []).append(timing)
        try:
            dfmt.write_json_atomic(run.meta_path, meta)
        except OSError:
            pass
        run.close()
    return {
        "out": str(run.path),
        "step": meta["step"],
        "eval": last_eval,
        "best": meta["best"],
        "timing": timing,
        "meta": meta,
    }
