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


def _head_arrays(target, n: int, run_path: Path) -> dict[str, np.ndarray]:
    """A ``--draft-vocab n`` head's frozen arrays: ``head_mask`` ((V,) bool, the ids it keeps, from counts
    stored in the run directory: ``token_counts.npz``, the file decoding reads next to the draft),
    ``head_ids`` (the kept ids) and ``head_col`` (each id's row in the trimmed head, -1 if dropped)."""
    from ssd_jax.drafters.vocab import always_kept, draft_token_counts, kept_ids

    counts = draft_token_counts(target, str(run_path))
    mask = np.zeros((target.cfg.vocab_size,), bool)
    mask[kept_ids(counts, n, always_kept(target.tokenizer))] = True
    ids = np.flatnonzero(mask).astype(np.int32)
    col = np.full(mask.shape, -1, np.int32)
    col[ids] = np.arange(ids.size, dtype=np.int32)
    return {"head_mask": mask, "head_ids": ids, "head_col": col}


def _load_data(args: TrainArgs, target, corpus: Corpus | None):
    """The run's data: (corpus, distill). ``--loss distill`` trains on stored target top-k (``distill``)
    while the held-out evaluation stays on the corpus; otherwise ``distill`` is None."""
    distill = None
    if args.loss == "distill":
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
    return corpus or build_corpus(args, target.tokenizer), distill


def _run_meta(args: TrainArgs, run: RunDir, target, cfg, shared: list[str], pr, law, init_idx, data_info):
    """The run's ``meta.json`` at step 0 (the draft format's header, the target, the draft's config and
    initialization, the training arguments and data); evaluations and the best draft are added as it runs."""
    tcfg = target.cfg
    shared_np = {n: np.asarray(target.params[n]) for n in shared}
    return {
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
            "data": data_info,
            "data_seed": args.seed,
        },
        "step": 0,
        "evals": [],
        "best": None,
    }


def _resume(args: TrainArgs, run: RunDir, meta: dict[str, Any], params, opt_state):
    """Where the run starts: (step, params, opt_state), restored from the latest complete checkpoint under
    ``--resume`` (its evaluations, best and timing history carried into ``meta``), else step 0."""
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
    return start, params, opt_state


@dataclasses.dataclass(frozen=True)
class _Step:
    """One training step: ``fn(params, opt_state, batch, frozen)``, the frozen arrays it takes, the batch
    of each step (``batch(step)``) and the learning-rate schedule (for the log)."""

    fn: Callable
    frozen: dict[str, Any]
    batch: Callable[[int], Any]
    sched: Callable[[int], Any]


def _make_step(args: TrainArgs, cfg, tcfg, opt, sched, corpus: Corpus, distill, frozen) -> _Step:
    """The step of ``--loss`` (the distillation step on stored top-k, or a step on the corpus with the target
    computed on the fly), with the part of ``frozen`` it reads."""
    if distill is not None:
        from ssd_jax.training.distill import distill_batch, make_distill_step

        return _Step(
            make_distill_step(cfg, args.distill_tail, float(args.ce_weight), opt),
            {k: v for k, v in frozen.items() if k != "target"},
            lambda step: distill_batch(distill, step, args.seed, args.batch_size, args.seq_len, args.pack),
            sched,
        )
    return _Step(
        make_train_step(cfg, tcfg, args.loss, opt),
        frozen if args.loss != "ce" else {"shared": frozen["shared"], "target": None},
        lambda step: train_batch(corpus.train, step, args.seed, args.batch_size, args.seq_len),
        sched,
    )


@dataclasses.dataclass(frozen=True)
class _Evals:
    """The run's evaluations and the drafts it exports: each evaluation is appended to ``meta``; the best
    (by alpha) is exported to the run's best directory, and with ``--keep-evals`` every evaluated draft."""

    args: TrainArgs
    run: RunDir
    meta: dict[str, Any]
    eval_fn: Callable
    frozen: dict[str, Any]
    batches: Any

    def evaluate(self, step: int, params) -> dict[str, Any]:
        t0 = time.perf_counter()
        m = evaluate(self.eval_fn, params, self.frozen, self.batches)
        m = {"step": step, **m, "eval_s": time.perf_counter() - t0}
        self.meta["evals"].append(_finite(m))
        log(
            f"eval step {step}: ppl {m['ppl']:.3f} (target {m['target_ppl']:.3f}), alpha {m['alpha']:.4f}, "
            f"greedy match {m['greedy_match']:.4f}, kl {m['kl']:.4f}  [{m['eval_s']:.1f}s]"
        )
        return m

    def export_best(self, step: int, m: dict[str, Any], params) -> None:
        meta = self.meta
        best = meta.get("best")
        if best is not None and best.get("alpha") is not None and m["alpha"] <= best["alpha"]:
            return
        meta["best"] = {
            "step": step,
            **_finite({k: m[k] for k in ("alpha", "greedy_match", "ppl", "target_ppl", "kl")}),
        }
        bmeta = {**meta, "step": step, "metrics": _finite(m), "params_sha256": tensors_sha256(params)}
        bmeta.pop("evals", None)
        self.run.export(self.run.best_dir, params, bmeta)

    def snapshot(self, step: int, m: dict[str, Any], params) -> None:
        """--keep-evals: the draft at this eval, for learning curves."""
        meta = self.meta
        if self.args.keep_evals:
            smeta = {**meta, "step": step, "metrics": _finite(m), "params_sha256": tensors_sha256(params)}
            smeta.pop("evals", None)
            self.run.export(self.run.path / EVALS_DIR / str(step), params, smeta)


@dataclasses.dataclass
class _Timing:
    """Step times: the first step's (compilation included) apart from the rest."""

    first: float | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    loss_tokens: float = 0.0  # distill: tokens with a loss in the timed steps

    def add(self, dt: float, metrics: dict[str, float]) -> None:
        if self.first is None:
            self.first = dt
        else:
            self.times.append(dt)
            self.loss_tokens += metrics.get("tokens", 0.0)

    def tokens_per_s(self, tokens_per_step: int) -> float:
        """Over the last 20 steps (for the progress bar)."""
        recent = self.times[-20:]
        return tokens_per_step / (sum(recent) / len(recent)) if recent else float("nan")

    def summary(self, tokens_per_step: int, device: str) -> dict[str, Any]:
        times = self.times
        return {
            "first_step_s": self.first,
            "steps": len(times),
            "step_s": (sum(times) / len(times)) if times else None,
            "tokens_per_s": tokens_per_step * len(times) / sum(times) if times else None,
            "loss_tokens_per_s": self.loss_tokens / sum(times) if times and self.loss_tokens else None,
            "device": device,
        }


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
    corpus, distill = _load_data(args, target, corpus)
    shared = shared_names(tcfg)
    frozen = {
        "shared": {n: target.params[n] for n in shared},
        "target": target.params,
    }
    pr = param_report(cfg, tcfg)
    meta = _run_meta(args, run, target, cfg, shared, pr, law, init_idx, corpus.info)

    opt, sched = make_optimizer(args)
    # committed to one device like the arrays orbax restores, so that a fresh and a resumed
    # run in one process share the compiled step
    dev = jax.devices()[0]
    params = jax.device_put(init_trained(target.params, tcfg, cfg, args.init_layers, args.seed), dev)
    opt_state = jax.device_put(opt.init(params), dev)
    start, params, opt_state = _resume(args, run, meta, params, opt_state)
    dfmt.write_json_atomic(run.meta_path, meta)
    log(
        f"draft: {cfg.num_layers} layers x {cfg.hidden_size} (init from target layers {init_idx}), "
        f"N = {pr['N']:,} trained + {pr['shared']:,} shared; SDSL N_opt = {law['n_opt']:.3g} "
        f"for M = {law['M']:,}; per-token cost {pr['cost_ratio']:.2f}x the target's"
    )

    evals = _Evals(
        args, run, meta, make_eval_step(cfg, tcfg), frozen,
        eval_batches(corpus.heldout, eval_batch_count(args), args.batch_size, args.seq_len),
    )  # fmt: skip
    if distill is not None and args.draft_vocab is not None:
        # evaluation masks full-width logits; the train step computes the kept rows only
        frozen.update(jax.device_put(_head_arrays(target, args.draft_vocab, run.path), dev))
        log(f"head trimmed to {args.draft_vocab} tokens (the ids --draft-vocab {args.draft_vocab} keeps)")
    train_step = _make_step(args, cfg, tcfg, opt, sched, corpus, distill, frozen)

    due = start == args.steps or (bool(args.eval_every) and start % args.eval_every == 0)
    if due and not any(e["step"] == start for e in meta["evals"]):
        # step 0, or a kill between saving an eval step's state and recording its evaluation
        m0 = evals.evaluate(start, params)
        evals.export_best(start, m0, params)
        evals.snapshot(start, m0, params)
        dfmt.write_json_atomic(run.meta_path, meta)
    return _run_steps(args, run, meta, evals, train_step, params, opt_state, start, on_step)


def _run_steps(
    args: TrainArgs, run: RunDir, meta: dict[str, Any], evals: _Evals, train_step: _Step, params, opt_state,
    start: int, on_step,
) -> dict[str, Any]:  # fmt: skip
    """The steps ``start`` to ``--steps``: each logged, evaluated every ``--eval-every`` and at the end,
    saved at evaluations and every ``--save-every``; the timing is recorded in ``meta`` however it ends."""
    import jax

    from ssd_jax.loading.store import progress

    tokens_per_step = args.batch_size * args.seq_len
    bar = progress(total=args.steps, initial=start, desc="train", unit="step", leave=True, mininterval=1.0)
    timing = _Timing()
    last_eval = meta["evals"][-1] if meta["evals"] else None
    try:
        for step in range(start, args.steps):
            batch = train_step.batch(step)
            t0 = time.perf_counter()
            params, opt_state, metrics = train_step.fn(params, opt_state, batch, train_step.frozen)
            metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
            timing.add(time.perf_counter() - t0, metrics)
            done = step + 1
            rec = {"step": done, "lr": float(train_step.sched(step)), **metrics}
            run.append_log(_finite(rec))
            if not math.isfinite(metrics["loss"]):
                last = dfmt.complete_steps(run.state_dir)
                raise UserError(
                    f"loss became {metrics['loss']} at step {done} (lr {rec['lr']:.3g}); training stopped, "
                    f"the last good checkpoint is step {last[0] if last else 'none'} in {run.path} "
                    f"(lower --lr or --clip and --resume)"
                )
            post = f"loss {metrics['loss']:.4f}" + (
                f" a {metrics['alpha']:.3f}" if "alpha" in metrics else ""
            )
            bar.set_postfix_str(f"{post} {timing.tokens_per_s(tokens_per_step):,.0f} tok/s", refresh=False)
            bar.update(1)
            is_eval = bool(args.eval_every) and done % args.eval_every == 0
            final = done == args.steps
            if is_eval or final:
                last_eval = evals.evaluate(done, params)
            if is_eval or final or done % args.save_every == 0:
                run.save(done, params, opt_state)
                meta["step"] = done
                if is_eval or final:
                    evals.export_best(done, last_eval, params)
                    evals.snapshot(done, last_eval, params)
                dfmt.write_json_atomic(run.meta_path, meta)
            if on_step is not None:
                on_step(done, rec)
    finally:
        bar.close()
        summary = timing.summary(tokens_per_step, str(jax.devices()[0].platform))
        meta.setdefault("timing_history", []).append(summary)
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
        "timing": summary,
        "meta": meta,
    }
