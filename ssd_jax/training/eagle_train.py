"""Training an EAGLE-style head (:mod:`ssd_jax.drafters.eagle`) with optax on the target's own answers.

``python -m ssd_jax.train eagle --target NAME --data DIR --out RUN`` (DIR from ``distill-data``: the
target's answers to training prompts; only their tokens are used, the target's features and full
next-token distributions are recomputed in each step). Each step is one jitted call: the frozen
target over the batch's windows, the head unrolled ``--depth`` draft steps (training-time test), the
KL from the target's distributions, AdamW. The run directory holds ``head.json`` (the recipe and the
target), the orbax training states (``--save-every``; a rerun with ``--resume`` continues from the
newest one that restores) and ``head.safetensors`` (the last saved head, written atomically), with
``train_log.jsonl``. Evaluation: teacher-forced greedy acceptance on held-out benchmark prompts in the
chat template, against the target's own greedy continuations (:func:`evaluate_head`).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.errors import UserError

from ssd_jax.drafters.eagle import HEAD_WEIGHTS, save_head

HEAD_META = "head.json"


def held_out_sequences(
    target, n_per_category: int, new_tokens: int, categories=("code", "chat"), seed: int = 1
):
    """Benchmark prompts (never training ones) in the chat template with the target's greedy
    continuations: (tokens (N, T) right-padded, mask (N, T): 1 where token j + 1 is generated).
    ``seed`` picks the prompts (0: the ones the benchmark suites use)."""
    from ssd_jax.data.prompts import load_prompts
    from ssd_jax.engine.generate import generate
    from ssd_jax.sampling.filters import SamplingParams

    tok = target.tokenizer
    prompts = []
    for c in categories:
        for p in load_prompts(c, n=n_per_category, seed=seed):
            text = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}])
            prompts.append(tok.encode(text)[-256:])
    res = generate(target, prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    seqs = [p + o["token_ids"] for p, o in zip(prompts, res.outputs)]
    T = max(len(s) for s in seqs)
    toks = np.zeros((len(seqs), T), np.int32)
    mask = np.zeros((len(seqs), T), np.float32)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        toks[i, : len(s)] = s
        mask[i, len(p) - 1 : len(s) - 1] = 1.0
    return toks, mask


def evaluate_head(head, target, spec, toks, mask, k: int = 4, batch: int = 4, ids=None) -> dict[str, float]:
    """Teacher-forced greedy acceptance: the share of positions whose first proposal matches the
    target's greedy token (alpha_1) and the mean accepted of K, with a 95% interval over sequences.
    ``tokens_per_round``: what greedy SD at this K emits a round when its rounds start where SD's do
    (the first after the prefill's token, then each after the last one emitted) rather than at every
    position: the rounds of a run begin just after a miss, which can be harder positions."""
    import jax.numpy as jnp

    from ssd_jax.drafters.eagle import greedy_acceptance

    firsts, means, by_pos, walk = [], [], [], []
    if ids is None and "vocab_ids" in head:
        ids = jnp.asarray(head["vocab_ids"])
    for i in range(0, len(toks), batch):
        ok, w = greedy_acceptance(
            head, target.params, jnp.asarray(toks[i : i + batch]), jnp.asarray(mask[i : i + batch]), ids,
            cfg=target.cfg, spec=spec, k=k,
        )  # fmt: skip
        ok, w = np.asarray(ok), np.asarray(w)
        for r in range(ok.shape[0]):
            if w[r].any():
                firsts.append(float((ok[r][w[r]] >= 1).mean()))
                means.append(float(ok[r][w[r]].mean()))
                by_pos.append([float((ok[r][w[r]] >= d).mean()) for d in range(1, k + 1)])
                j = int(np.flatnonzero(w[r])[0]) + 1  # the prefill emitted the first answer token
                while j < w.shape[1] and w[r, j]:
                    walk.append(int(ok[r, j]) + 1)
                    j += int(ok[r, j]) + 1

    def ci(xs):
        xs = np.asarray(xs)
        h = 1.96 * xs.std(ddof=1) / np.sqrt(len(xs)) if len(xs) > 1 else float("nan")
        return float(xs.mean()), float(h)

    a1, a1_h = ci(firsts)
    m, m_h = ci(means)
    return {"alpha_1": a1, "alpha_1_ci": a1_h, "accepted_of_k": m, "accepted_of_k_ci": m_h, "k": k,
            "p_first_d_accepted": np.mean(by_pos, axis=0).round(4).tolist(), "sequences": len(firsts),
            "tokens_per_round": float(np.mean(walk)) if walk else float("nan"), "rounds": len(walk)}  # fmt: skip


def scored_positions(b: dict, prompt_weight: float) -> np.ndarray:
    """The loss weights of a batch's positions: 1 where the token predicted is one of the target's
    generated tokens, ``prompt_weight`` where it is a prompt token (the target's distribution there
    is computed in the step all the same), 0 on padding."""
    seg = b["segments"]
    prompt = np.zeros_like(b["mask"])
    prompt[:, :-1] = ((seg[:, :-1] > 0) & (seg[:, 1:] > 0)).astype(np.float32)
    return np.maximum(b["mask"], prompt_weight * prompt * (b["mask"] == 0))


def corpus_stream(target, n_tokens: int) -> np.ndarray:
    """The training corpus's text (ShareGPT conversations in the chat template, code, maths) as one
    token stream of ``n_tokens``: windows the head learns the target's distributions on besides its
    own answers (the target runs in each step, so any text serves)."""
    from ssd_jax.training.corpus import corpus_docs, token_stream

    stream, _ = token_stream(corpus_docs("corpus", "train"), target.tokenizer, n_tokens)
    return stream


def head_vocab_ids(target, n: int | None):
    """The kept ids of an ``n``-token head (the counts ``--draft-vocab`` uses), or None for the full one."""
    if n is None or n >= target.cfg.vocab_size:
        return None
    from ssd_jax.drafters.vocab import always_kept, draft_token_counts, kept_ids

    return np.asarray(kept_ids(draft_token_counts(target), n, always_kept(target.tokenizer)), np.int32)


def train_head(
    target_name: str,
    data: str,
    out: str,
    *,
    steps: int = 1000,
    batch: int = 4,
    seq_len: int = 256,
    lr: float = 1e-3,
    depth: int = 3,
    layers: tuple[int, ...] | None = None,
    seed: int = 0,
    vocab: int | None = 8192,
    prompt_weight: float = 1.0,
    corpus_rows: int = 0,
    cached_windows: int = 0,
    head_mlp: int | None = None,
    save_dtype: str | None = None,
    init: str | None = None,
    save_every: int = 50,
    resume: bool = False,
    eval_prompts: int = 8,
    log=print,
) -> dict[str, Any]:
    """Train (or ``resume``) a head for ``target_name`` on the answers in ``data`` (None: the corpus
    only, ``corpus_rows == batch``); returns the summary. ``cached_windows``: run the target once over
    that many windows (:mod:`ssd_jax.training.eagle_cache`) and train on them for ``steps`` steps
    (epochs over them) instead of running it in every step. ``head_mlp``: the layer's MLP width.
    ``init``: start from a trained head (a shipped name or a directory) instead of random weights."""
    import jax

    from ssd_jax.drafters import eagle
    from ssd_jax.loading import load_model
    from ssd_jax.training.checkpoint import RunDir
    from ssd_jax.training.distill_data import load_distill_data

    target = load_model(target_name, dtype="float32")
    spec = eagle.HeadSpec(tuple(layers) if layers else eagle.default_layers(target.cfg.num_layers))
    spec.validate(target.cfg)
    if data is None and corpus_rows != batch:
        raise UserError("without --data every row is corpus text: pass --corpus-rows equal to --batch-size")
    dd = load_distill_data(data) if data is not None else None
    run = RunDir(out)
    recipe = {"target": target_name, "target_sha256": target.weights_sha256, "layers": list(spec.layers), "depth": depth,
              "batch": batch, "seq_len": seq_len, "lr": lr, "seed": seed, "data": str(data), "steps": steps,
              "vocab": vocab, "prompt_weight": prompt_weight, "corpus_rows": corpus_rows}  # fmt: skip
    if cached_windows or head_mlp:  # recorded only when used: older runs' recipes stay valid for --resume
        recipe.update(cached_windows=cached_windows, head_mlp=head_mlp)
    ids = head_vocab_ids(target, vocab)
    head = eagle.init_head(target.cfg, spec, seed=seed, mlp=head_mlp)
    if init is not None:
        head, recipe["init"] = warm_start(head, init, target, spec, ids)
    _write_recipe(run, out, recipe, resume)
    opt = _optimizer(lr, steps)
    start, head, state = _restore(run, head, opt.init(head), resume, log)
    step_fn = eagle.make_head_step(target.cfg, spec, depth, opt, cached=bool(cached_windows))
    inputs = _step_inputs(
        Path(out), target, spec, dd, steps=steps, batch=batch, corpus_rows=corpus_rows, seq_len=seq_len,
        seed=seed, cached_windows=cached_windows, prompt_weight=prompt_weight, log=log,
    )  # fmt: skip
    ids_d = None if ids is None else jax.numpy.asarray(ids)
    held = held_out_sequences(target, eval_prompts, 48) if eval_prompts else None
    save_weights = functools.partial(save_head, Path(out) / HEAD_WEIGHTS, vocab_ids=ids, dtype=save_dtype)
    head, train_s, toks_seen = _train_steps(
        run, step_fn, inputs, head, state, target.params, ids_d, save_weights, recipe,
        start=start, steps=steps, save_every=save_every,
    )  # fmt: skip
    summary = {"out": out, "steps": steps, "train_s": train_s, "scored_tokens": toks_seen,
               "head_params": eagle.count_head_params(head), "layers": list(spec.layers)}  # fmt: skip
    if held is not None:  # K = 8 (K auto's largest): the curve K auto reads from the head's file
        from ssd_jax.decoding.spec import K_MAX

        ev = evaluate_head(jax.device_get(head), target, spec, *held, k=K_MAX, ids=ids_d)
        summary["held_out"] = ev
        run.append_log({"eval": ev, "step": steps})
        meta = {**recipe, "step": steps, "acceptance_by_position": ev["p_first_d_accepted"], "held_out": ev}
        save_weights(head, meta)
    return summary


def _write_recipe(run, out: str, recipe: dict[str, Any], resume: bool) -> None:
    """The recipe written to the run directory's ``head.json``. A directory that holds a run is continued
    only under ``resume`` with the same recipe (but ``steps``); anything else is refused in one line."""
    meta_path = Path(out) / HEAD_META
    if run.has_run() or meta_path.exists():
        if not resume:
            raise UserError(f"{out} holds a run: pass --resume to continue it, or another --out")
        old = json.loads(meta_path.read_text())
        old = {"vocab": None, "prompt_weight": 0.0, "corpus_rows": 0, **old}  # runs from before these options
        diff = sorted(k for k in recipe if k != "steps" and old.get(k) != recipe[k])
        if diff:
            raise UserError(f"--resume with a different recipe ({', '.join(diff)}): use another --out")
    Path(out).mkdir(parents=True, exist_ok=True)
    meta_path.write_text(json.dumps(recipe, indent=1))


def _optimizer(lr: float, steps: int):
    """AdamW (no weight decay) with gradients clipped to norm 1, the learning rate warming up over the
    first tenth of the steps (at most 100) and decaying to a tenth of ``lr`` by a cosine."""
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10 + 1), steps, lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))


def _restore(run, head, state, resume: bool, log):
    """Where the run starts: (step, head, optimizer state), from the newest training state that restores
    under ``resume``, else step 0 and the ones given."""
    if resume and (got := run.restore_latest(head, state)) is not None:
        log(f"resumed at step {got[0]}")
        return got
    return 0, head, state


def _step_inputs(
    out: Path,
    target,
    spec,
    dd,
    *,
    steps,
    batch,
    corpus_rows,
    seq_len,
    seed,
    cached_windows,
    prompt_weight,
    log,
):
    """The inputs of step ``s``, ``inputs(s)``: the stored (tokens, features, hidden, lse, top, weights) of
    a feature cache's windows (``cached_windows``), or (tokens, weights) of the target's answers in
    ``dd`` (``batch - corpus_rows`` rows) and the corpus's text (``corpus_rows`` rows)."""
    from ssd_jax.training.corpus import train_batch, window_ids
    from ssd_jax.training.distill import distill_batch

    if not 0 <= corpus_rows <= batch or (corpus_rows == batch and dd is not None):
        raise UserError(
            f"--corpus-rows must lie in 0..{batch - 1} (the rest of the batch is the target's answers)"
        )
    if cached_windows:
        cache = _feature_cache(
            out, target, spec, dd, cached_windows, batch, corpus_rows, seq_len, seed, prompt_weight, log
        )
        return lambda s: cache.batch(window_ids(s, seed, batch, cache.n))
    n_stream = steps * corpus_rows * seq_len + 1 if corpus_rows else 0
    stream = corpus_stream(target, n_stream) if n_stream else None

    def inputs(s):
        b = distill_batch(dd, s, seed, batch - corpus_rows, seq_len)
        tokens, w = b["tokens"][:, :-1], scored_positions(b, prompt_weight)
        if stream is not None:  # corpus windows: every position scored (the target's p needs no next token)
            c = train_batch(stream, s, seed, corpus_rows, seq_len)[:, :-1]
            tokens, w = np.concatenate([tokens, c]), np.concatenate([w, np.ones(c.shape, np.float32)])
        return (tokens, w)

    return inputs


def _train_steps(
    run, step_fn, inputs, head, state, target_params, ids_d, save_weights, recipe, *, start, steps, save_every
):
    """Steps ``start`` to ``steps``: logged every 10, saved (the training state and the head's file) every
    ``save_every`` and at the end. Returns (head, seconds, scored tokens seen)."""
    from tqdm import tqdm

    t0, toks_seen = time.perf_counter(), 0
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="eagle head", disable=None)
    for s in bar:
        args = inputs(s)
        head, state, loss, stats = step_fn(head, state, target_params, *args, ids_d)
        toks_seen += int((args[-1] > 0).sum())
        if (s + 1) % 10 == 0:
            st = {k: float(v) for k, v in stats.items()}
            bar.set_postfix(loss=f"{float(loss):.3f}", agree1=f"{st['agree_1']:.2f}")
            run.append_log({"step": s + 1, "loss": float(loss), **st, "elapsed_s": time.perf_counter() - t0})
        if (s + 1) % save_every == 0 or s + 1 == steps:
            run.save(s + 1, head, state)
            save_weights(head, {**recipe, "step": s + 1})
    return head, time.perf_counter() - t0, toks_seen


def warm_start(head, src: str, target, spec, ids) -> tuple[dict, dict[str, Any]]:
    """``head``'s parameters replaced by those of the trained head ``src`` (a shipped name, a directory
    or a file, as ``--draft eagle:PATH`` takes them), and what the recipe records of it. It must have
    been trained for this target (checked as decoding checks it) with the same layers, kept vocabulary
    and shapes (``--head-mlp``); anything else is refused in one line."""
    import jax

    from ssd_jax.drafters.eagle import PREFIX, eagle_source, load_eagle
    from ssd_jax.loading.registry import sha256_file

    ref = PREFIX + src.removeprefix(PREFIX)
    got, meta = load_eagle(target, ref)  # in the target's dtype, the head's own
    kept = got.pop("vocab_ids", None)
    why = None
    if list(meta["layers"]) != list(spec.layers):
        why = f"it reads layers {meta['layers']}, not {list(spec.layers)}"
    elif (kept is None) != (ids is None) or (ids is not None and not np.array_equal(np.asarray(kept), ids)):
        why = "its vocabulary differs (--draft-vocab)"
    elif jax.tree.map(np.shape, got) != jax.tree.map(np.shape, head):
        why = "its shapes differ (--head-mlp)"
    if why:
        raise UserError(f"--init {src}: {why}")
    p = Path(eagle_source(ref))
    weights = p / HEAD_WEIGHTS if p.is_dir() else p
    return got, {"from": src, "sha256": sha256_file(weights), "step": meta.get("step")}


def _feature_cache(out: Path, target, spec, dd, n, batch, corpus_rows, seq_len, seed, prompt_weight, log):
    """The run's feature cache over ``n`` windows: the target's answers in the share of rows a batch
    gives them, the corpus's text in the rest (every position scored)."""
    from ssd_jax.training.distill import distill_batch
    from ssd_jax.training.eagle_cache import FeatureCache, build_cache

    n_corpus = n if dd is None else round(n * corpus_rows / batch)
    toks, weights = [], []
    if n - n_corpus:
        b = distill_batch(dd, 0, seed, n - n_corpus, seq_len)
        toks.append(b["tokens"][:, :-1])
        weights.append(scored_positions(b, prompt_weight))
    if n_corpus:
        stream = corpus_stream(target, n_corpus * seq_len)
        if len(stream) < n_corpus * seq_len:
            raise UserError(
                f"the corpus holds {len(stream) // seq_len} windows of {seq_len}, fewer than asked"
            )
        toks.append(stream[: n_corpus * seq_len].reshape(n_corpus, seq_len))
        weights.append(np.ones((n_corpus, seq_len), np.float32))
    path = build_cache(out, target, spec.layers, np.concatenate(toks), np.concatenate(weights), log=log)
    return FeatureCache(path)
