"""Draft training: ``python -m ssd_jax.train --target NAME_OR_PATH --size auto``.

Trains a draft model for speculative decoding against a given target, sized by the SDSL
scaling law (``ssd_jax.sdsl``), and writes resumable orbax checkpoints that load anywhere a
draft is accepted (``--draft checkpoints/<name>``).

Architecture and sizing
-----------------------
The draft shares the target's tokenizer AND its embedding table (and output head when the
target's is untied): it has the target's width, heads and FFN width, and only its depth is
chosen. The shared tensors are frozen during training and not stored with the draft, so
a draft of a 135M target stores ≈10M parameters (≈42 MB in float32) instead of carrying its
own 28M-parameter (49152 × 576) embedding. Sharing also pins the width: with the width fixed,
the parameter budget N sets the number of layers (``round(N / params per layer)``, at least 1).

Parameter counts, the convention used: the law's target size M is the target's TOTAL
parameter count with tied embeddings counted once (as ``ssd_jax.sdsl`` documents: the
convention of the model sizes the paper fits). The draft's N is the count of parameters it
adds to the shared embedding: its layers and final norm, i.e. its NON-embedding count.
Counting the shared embedding in N is not possible at this scale: for SmolLM2-135M the law
gives N_opt ≈ 10.9M, smaller than the 28.3M shared embedding alone. Note what this means for
the law's cost model (weight reads per token): the draft's tied output head still reads the
whole V × D table every step, so its real per-token cost is ``N + V·D`` (SmolLM2: ≈39M, 29%
of the target), which the checkpoint metadata records next to N (``params.reads_per_token``).

Initialisation: layers are copied from the target (``--init-layers``: ``spread`` picks evenly
spaced target layers including the first and last, ``first`` the first ones, ``none`` a
random init, or an explicit list such as ``0,15,29``); the final norm is the target's.

Data, loss, optimiser
---------------------
Real text (``ssd_jax.data``): ShareGPT conversations rendered with the target's chat
template, plus HumanEval, MT-bench and CHAMP texts, tokenized with the target's tokenizer
into one stream per split (documents separated by EOS; the held-out split is the data
module's fixed ~5%; evaluation takes at most two windows from each held-out document, so it
spans many of them). ``--data FILE`` uses a .txt (documents split on blank lines) or .jsonl
(``"text"`` field) file instead. Training windows of ``seq_len + 1`` tokens are drawn from
the stream in an order that is a pure function of (seed, step): window ``step·B + b`` comes
from a per-epoch permutation seeded by (seed, epoch), so a resumed run sees the same data.

Losses: ``ce`` next-token cross-entropy; ``kl`` forward KL(p_target || q_draft) at
temperature 1 against the target's logits computed on the fly (distillation; minimising it
raises the acceptance α = Σ min(p, q) = 1 − TV(p, q)); ``mix`` their mean. optax AdamW
(β = 0.9, 0.95; no decay on norms) with linear warmup + cosine decay to 10% and global-norm
clipping. One jitted ``train_step(params, opt_state, batch, frozen) -> (params, opt_state,
metrics)`` per step; ``frozen`` holds the shared tensors and the teacher's parameters (never
donated, never updated).

Evaluation (every ``--eval-every`` steps and at step 0, on fixed held-out windows): the
draft's perplexity, the target's, the KL, the acceptance α = E_t Σ_x min(p, q) at temperature
1 and the greedy match rate P(argmax q = argmax p), from the two distributions directly.

Checkpoints: see :mod:`ssd_jax.loading.draft` for the layout. ``--resume`` restores the
newest complete step (orbax finalises a step by renaming it into place, so a kill -9 during
a save leaves the previous step intact), cuts the log and eval history back to it, and
continues with the same data order: the result is bit-identical to an uninterrupted run.
A NaN/inf loss stops training without saving, keeping the last good checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.errors import UserError
from ssd_jax.loading import draft as dfmt
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import count_params, flatten, layer_specs, weight_bytes_per_token

LOSSES = ("ce", "kl", "mix")
INIT_MODES = ("spread", "first", "none")
_CORPUS_SOURCES = ("humaneval", "mtbench", "champ")  # ShareGPT comes in as whole conversations
_HELDOUT_EVERY = 20  # --data FILE: documents whose hash is 0 mod 20 are held out

# training arguments that must match when resuming (the others may change freely)
_RESUME_KEYS = (
    "steps", "batch_size", "seq_len", "lr", "warmup", "weight_decay", "clip", "loss", "seed", "init_layers", "data",
)


# ------------------------------------------------------------------------------- arguments
@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """Everything a training run depends on (the CLI flags).

    Attributes:
      target: registry name or path of the target model.
      size: "auto" (SDSL N_opt for the target) or a parameter count for the draft's
        non-embedding parameters ("10M", "1.2e7").
      steps, batch_size, seq_len: optimisation steps, windows per step, tokens per window.
      lr, warmup, weight_decay, clip: AdamW peak learning rate, warmup steps (None: 10% of
        the steps, at most 100), decoupled weight decay, global-norm clip.
      loss: "ce", "kl" or "mix".
      seed: data order (and random init with ``init_layers="none"``).
      eval_every: evaluate (and save) every this many steps; 0 only at the end.
      eval_windows: held-out windows per evaluation (rounded up to whole batches).
      save_every: save the training state every this many steps (None: with each eval).
      keep: training states kept in ``state/``.
      init_layers: "spread", "first", "none" or comma-separated target layer indices.
      data: "corpus" (the shipped prompt sets) or a .txt/.jsonl file.
      out: output directory (None: ``checkpoints/<target>-draft``).
      resume: continue the run in ``out``.
      dtype: dtype the target is loaded in (the draft trains in float32; only float32 is tested).
    """

    target: str
    size: str = "auto"
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 5e-4
    warmup: int | None = None
    weight_decay: float = 0.01
    clip: float = 1.0
    loss: str = "kl"
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 16
    save_every: int | None = None
    keep: int = 2
    init_layers: str = "spread"
    data: str = "corpus"
    out: str | None = None
    resume: bool = False
    dtype: str = "float32"

    def resolved(self) -> TrainArgs:
        warmup = self.warmup if self.warmup is not None else min(100, self.steps // 10)
        out = self.out or str(Path("checkpoints") / f"{_slug(self.target)}-draft")
        save_every = self.save_every if self.save_every is not None else (self.eval_every or self.steps)
        return dataclasses.replace(self, warmup=warmup, out=out, save_every=save_every)

    def check(self) -> None:
        if self.steps < 1:
            raise UserError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size < 1 or self.seq_len < 2:
            raise UserError(f"--batch-size must be >= 1 and --seq-len >= 2, got {self.batch_size}, {self.seq_len}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.warmup is not None and self.warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {self.warmup}")
        if self.loss not in LOSSES:
            raise UserError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.eval_every < 0 or self.eval_windows < 1 or self.keep < 1:
            raise UserError("--eval-every must be >= 0, --eval-windows >= 1 and --keep >= 1")
        if self.save_every is not None and self.save_every < 1:
            raise UserError(f"--save-every must be >= 1, got {self.save_every}")
        if self.clip <= 0 or self.weight_decay < 0:
            raise UserError("--clip must be > 0 and --weight-decay >= 0")
        parse_size(self.size)


def _slug(name: str) -> str:
    base = Path(str(name).rstrip("/")).name or "target"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in base)


def parse_size(s: str | float) -> float | None:
    """``"auto"`` -> None; "10M", "1.2e7", 5000 -> a positive parameter count."""
    from ssd_jax.sdsl import _parse_size

    if isinstance(s, str) and s.strip().lower() == "auto":
        return None
    try:
        v = _parse_size(str(s))
    except UserError:
        raise UserError(f"--size must be 'auto' or a positive parameter count such as 10M, got {s!r}") from None
    if v < 1:
        raise UserError(f"--size must be 'auto' or a positive parameter count, got {s!r}")
    return v


# ------------------------------------------------------------------------------- sizing
def layer_param_count(cfg: ModelConfig) -> int:
    return sum(int(np.prod(shape)) for shape, _ in layer_specs(cfg).values())


def shared_names(cfg: ModelConfig) -> list[str]:
    """The target tensors a draft of ``cfg``'s width shares instead of storing."""
    return ["embed"] if cfg.tie_embeddings else ["embed", "lm_head"]


def size_draft(target_cfg: ModelConfig, size: str | float) -> tuple[ModelConfig, dict[str, Any]]:
    """The draft's config for a parameter budget, and how it was sized (for the metadata).

    The width, heads and FFN are the target's (the embedding is shared); the depth is
    ``round(N / params per layer)``, at least 1, where N counts the draft's non-embedding
    parameters. ``size="auto"``: N = SDSL N_opt for the target's total parameter count.
    """
    from ssd_jax import sdsl

    n_req = parse_size(size)
    m_total = count_params(target_cfg)
    m_nonemb = count_params(target_cfg, include_embeddings=False)
    law: dict[str, Any] = {
        "M": m_total,
        "M_convention": "target total parameters, tied embeddings counted once (ssd_jax.sdsl)",
        "N_convention": "draft parameters excluding the embedding shared with the target (its layers + final norm)",
        "n_opt": sdsl.n_opt(m_total),
        "n_opt_if_M_nonembedding": sdsl.n_opt(m_nonemb),
        "target_nonembedding": m_nonemb,
    }
    n = law["n_opt"] if n_req is None else n_req
    per_layer = layer_param_count(target_cfg)
    depth = max(1, int(round((n - target_cfg.hidden_size) / per_layer)))
    cfg = target_cfg.replace(num_layers=depth)
    law.update(sizing="auto" if n_req is None else "explicit", n_requested=n, params_per_layer=per_layer)
    if depth >= target_cfg.num_layers:
        warnings.warn(
            f"--size {size} gives a draft with {depth} layers, as deep as or deeper than the target "
            f"({target_cfg.num_layers} layers): speculation cannot pay off",
            stacklevel=2,
        )
    return cfg, law


def param_report(cfg: ModelConfig, target_cfg: ModelConfig) -> dict[str, Any]:
    shared = shared_names(cfg)
    n_shared = sum(cfg.vocab_size * cfg.hidden_size for _ in shared)
    trained = count_params(cfg) - n_shared
    reads = weight_bytes_per_token(cfg, 1)
    return {
        "trained": trained,
        "shared": n_shared,
        "total": trained + n_shared,
        "N": trained,
        "reads_per_token": reads,
        "target_reads_per_token": weight_bytes_per_token(target_cfg, 1),
        "cost_ratio": reads / weight_bytes_per_token(target_cfg, 1),
    }


def init_layer_indices(mode: str, target_layers: int, depth: int) -> list[int] | None:
    """Which target layers initialise the draft's layers (None: random init)."""
    m = str(mode).strip().lower()
    if m == "none":
        return None
    if m == "first":
        return [min(i, target_layers - 1) for i in range(depth)]
    if m == "spread":
        if depth == 1:
            return [0]
        return [round(i * (target_layers - 1) / (depth - 1)) for i in range(depth)]
    try:
        idx = [int(x) for x in m.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--init-layers must be {', '.join(INIT_MODES)} or a list of layer indices, got {mode!r}") from None
    if len(idx) != depth or any(not 0 <= i < target_layers for i in idx):
        raise UserError(f"--init-layers {mode!r}: need {depth} indices in [0, {target_layers}) for this draft")
    return idx


def init_trained(target_params, target_cfg: ModelConfig, cfg: ModelConfig, mode: str, seed: int) -> dict[str, Any]:
    """The draft's trainable pytree ``{"layers": [...], "final_norm"}`` (fresh buffers, float32)."""
    import jax.numpy as jnp

    from ssd_jax.models.params import init_params

    idx = init_layer_indices(mode, target_cfg.num_layers, cfg.num_layers)
    if idx is None:
        rnd = init_params(cfg.replace(dtype="float32"), seed)
        layers = rnd["layers"]
    else:
        layers = [{k: jnp.array(v, jnp.float32, copy=True) for k, v in target_params["layers"][i].items()} for i in idx]
    return {"layers": layers, "final_norm": jnp.array(target_params["final_norm"], jnp.float32, copy=True)}


# ------------------------------------------------------------------------------- data
@dataclasses.dataclass
class Corpus:
    """Token streams for training and held-out evaluation, plus where they came from."""

    train: np.ndarray  # (n,) int32
    heldout: np.ndarray
    info: dict[str, Any]


def _doc_heldout(text: str) -> bool:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big") % _HELDOUT_EVERY == 0


def _file_texts(path: Path) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --data {path}: {e}") from None
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(raw.splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                texts.append(str(rec["text"]))
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--data {path}: line {i + 1} is not a JSON object with a \"text\" field") from None
        return [t for t in texts if t.strip()]
    return [t for t in raw.split("\n\n") if t.strip()]


def corpus_docs(data: str, split: str) -> list[str | list[dict[str, str]]]:
    """Documents of ``split`` ("train"/"heldout") in a fixed order: texts, or chat messages
    (ShareGPT conversations) that :func:`render` formats with the chat template when needed."""
    if data != "corpus":
        p = Path(data).expanduser()
        if not p.is_file():
            raise UserError(f"--data must be 'corpus' or an existing .txt/.jsonl file, got {data!r}")
        docs = [t for t in _file_texts(p) if _doc_heldout(t) == (split == "heldout")]
        if not docs:
            raise UserError(f"--data {p}: no {split} documents (every {_HELDOUT_EVERY}th document by hash is held out)")
        return list(docs)
    from ssd_jax import data as D

    docs: list[str | list[dict[str, str]]] = list(D.training_texts(split, sources=_CORPUS_SOURCES))
    for conv in D.sharegpt_conversations(split):
        msgs = [{"role": t["role"], "content": t["text"]} for t in conv["turns"] if t["text"].strip()]
        if msgs:
            docs.append(msgs)
    random.Random(f"ssd_jax.train/{split}").shuffle(docs)  # mix the sources; fixed, not seeded
    return docs


def render(doc: str | list[dict[str, str]], tokenizer) -> str:
    if isinstance(doc, str):
        return doc
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(doc, add_generation_prompt=False)
    return "\n\n".join(m["content"] for m in doc)


def token_stream(
    docs: list, tokenizer, n_tokens: int, chunk: int = 256, per_doc: int | None = None
) -> tuple[np.ndarray, int]:
    """The first ``n_tokens`` tokens (or all) of the documents joined by EOS, each document cut
    to ``per_doc`` tokens if given; returns (stream, documents used)."""
    eos = tokenizer.eos_token_id
    parts: list[np.ndarray] = []
    total = used = 0
    for i in range(0, len(docs), chunk):
        texts = [render(d, tokenizer) for d in docs[i : i + chunk]]
        for enc in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
            ids = list(enc.ids)[:per_doc] + ([eos] if eos is not None else [])
            parts.append(np.asarray(ids, np.int32))
            total += len(ids)
            used += 1
            if total >= n_tokens:
                break
        if total >= n_tokens:
            break
    stream = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    return stream[:n_tokens], used


def build_corpus(args: TrainArgs, tokenizer) -> Corpus:
    """Tokenize as much text as the run needs (it then sees each window once) or all of it."""
    if tokenizer is None:
        raise UserError(f"target {args.target} has no tokenizer: cannot tokenize training text")
    need_train = args.steps * args.batch_size * args.seq_len + 1
    need_eval = _eval_batches(args) * args.batch_size * args.seq_len + 1
    streams, info = {}, {"data": args.data}
    # held out: at most two windows per document, so an evaluation spans many documents
    for split, need, per_doc in (("train", need_train, None), ("heldout", need_eval, 2 * args.seq_len)):
        s, used = token_stream(corpus_docs(args.data, split), tokenizer, need, per_doc=per_doc)
        if len(s) < args.seq_len + 1:
            raise UserError(f"{split} data has only {len(s)} tokens, fewer than one window of {args.seq_len + 1}")
        streams[split] = s
        info[split] = {
            "documents": used,
            "tokens": int(len(s)),
            "sha256": hashlib.sha256(s.tobytes()).hexdigest(),
            "epochs": need / len(s) if split == "train" else None,
        }
    return Corpus(streams["train"], streams["heldout"], info)


def _eval_batches(args: TrainArgs) -> int:
    return -(-args.eval_windows // args.batch_size)


@functools.lru_cache(maxsize=4)
def _epoch_perm(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def train_batch(stream: np.ndarray, step: int, seed: int, batch: int, seq_len: int) -> np.ndarray:
    """Windows ``(batch, seq_len + 1)`` for ``step`` (0-based): a pure function of (seed, step).

    Window starts are multiples of ``seq_len``; global window ``step·batch + b`` is entry
    ``(step·batch + b) mod n`` of a permutation seeded by ``(seed, epoch)``.
    """
    n = (len(stream) - 1) // seq_len
    out = np.empty((batch, seq_len + 1), np.int32)
    for b in range(batch):
        g = step * batch + b
        w = int(_epoch_perm(seed, g // n, n)[g % n])
        out[b] = stream[w * seq_len : w * seq_len + seq_len + 1]
    return out


def eval_batches(stream: np.ndarray, batches: int, batch: int, seq_len: int) -> list[np.ndarray]:
    """Fixed held-out windows (the first ones of the stream; repeated if it is short)."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(batches * batch) % n
    wins = np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in idx]).astype(np.int32)
    return [wins[i * batch : (i + 1) * batch] for i in range(batches)]


# ------------------------------------------------------------------------------- model, loss
def causal_logits(params, cfg: ModelConfig, tokens_BxT):
    """Logits of a causal pass over whole sequences (the shared forward, with a fresh KV cache)."""
    from ssd_jax.models import llama

    B, T = tokens_BxT.shape
    hidden_BxTxD, _ = llama.forward(params, cfg, tokens_BxT, llama.init_cache(cfg, B, T))
    return llama.logits(params, cfg, hidden_BxTxD)


def token_stats(logits_q_BxTxV, logits_p_BxTxV, labels_BxT) -> dict[str, Any]:
    """Per-position statistics of draft q against the labels and (if given) the target p."""
    import jax
    import jax.numpy as jnp

    logq = jax.nn.log_softmax(logits_q_BxTxV, axis=-1)
    out = {"ce": -jnp.take_along_axis(logq, labels_BxT[..., None], axis=-1)[..., 0]}
    if logits_p_BxTxV is not None:
        logp = jax.nn.log_softmax(logits_p_BxTxV, axis=-1)
        p = jnp.exp(logp)
        out["kl"] = jnp.sum(p * (logp - logq), axis=-1)
        out["target_ce"] = -jnp.take_along_axis(logp, labels_BxT[..., None], axis=-1)[..., 0]
        out["alpha"] = jnp.sum(jnp.minimum(p, jnp.exp(logq)), axis=-1)
        out["greedy"] = (jnp.argmax(logits_q_BxTxV, -1) == jnp.argmax(logits_p_BxTxV, -1)).astype(jnp.float32)
    return out


def combine_loss(kind: str, stats: dict[str, Any]):
    import jax.numpy as jnp

    if kind == "ce":
        return jnp.mean(stats["ce"])
    if kind == "kl":
        return jnp.mean(stats["kl"])
    return 0.5 * (jnp.mean(stats["ce"]) + jnp.mean(stats["kl"]))


def make_optimizer(args: TrainArgs):
    """(optax optimizer, learning-rate schedule): clip -> AdamW with warmup + cosine to 10%.

    Cached by the hyper-parameters, so runs with equal ones share one optimizer object and
    hence the compiled steps of :func:`make_train_step`.
    """
    return _optimizer(args.lr, int(args.warmup or 0), args.steps, args.weight_decay, args.clip)


@functools.lru_cache(maxsize=8)
def _optimizer(lr: float, warmup: int, steps: int, weight_decay: float, clip: float):
    import jax
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=0.1 * lr)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # no decay on norms
    opt = optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )
    return opt, sched


def _global_norm(tree):
    import optax

    tree_norm = getattr(getattr(optax, "tree", None), "norm", None)  # optax >= 0.2.5; global_norm is deprecated
    return tree_norm(tree) if tree_norm is not None else optax.global_norm(tree)


@functools.lru_cache(maxsize=8)
def make_train_step(cfg: ModelConfig, target_cfg: ModelConfig, kind: str, optimizer) -> Callable:
    """One jitted step ``(params, opt_state, batch_Bx(T+1), frozen) -> (params, opt_state, metrics)``.

    ``params`` is the draft's trainable pytree (donated), ``frozen`` = {"shared": the
    target's shared tensors, "target": the teacher's parameters or None for ``ce``}.
    """
    import jax
    import optax

    def step(params, opt_state, batch_BxT1, frozen):
        tokens, labels = batch_BxT1[:, :-1], batch_BxT1[:, 1:]
        teacher = None
        if kind != "ce":
            teacher = jax.lax.stop_gradient(causal_logits(frozen["target"], target_cfg, tokens))

        def loss_fn(p):
            stats = token_stats(causal_logits({**frozen["shared"], **p}, cfg, tokens), teacher, labels)
            return combine_loss(kind, stats), stats

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads), "ce": stats["ce"].mean()}
        if teacher is not None:
            metrics.update(kl=stats["kl"].mean(), alpha=stats["alpha"].mean())
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=8)
def make_eval_step(cfg: ModelConfig, target_cfg: ModelConfig) -> Callable:
    """Jitted ``(params, frozen, batch) -> sums`` of the held-out statistics over positions."""
    import jax
    import jax.numpy as jnp

    def ev(params, frozen, batch_BxT1):
        tokens, labels = batch_BxT1[:, :-1], batch_BxT1[:, 1:]
        p = causal_logits(frozen["target"], target_cfg, tokens)
        q = causal_logits({**frozen["shared"], **params}, cfg, tokens)
        return {k: jnp.sum(v) for k, v in token_stats(q, p, labels).items()}

    return jax.jit(ev)


def evaluate(eval_fn, params, frozen, batches: list[np.ndarray]) -> dict[str, float]:
    sums: dict[str, float] = {}
    n = 0
    for b in batches:
        out = eval_fn(params, frozen, b)
        for k, v in out.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        n += b.shape[0] * (b.shape[1] - 1)
    m = {k: v / n for k, v in sums.items()}
    return {
        "ppl": math.exp(min(m["ce"], 50.0)),
        "target_ppl": math.exp(min(m["target_ce"], 50.0)),
        "ce": m["ce"],
        "kl": m["kl"],
        "alpha": m["alpha"],
        "greedy_match": m["greedy"],
        "tokens": n,
    }


# ------------------------------------------------------------------------------- checkpoints
def tensors_sha256(params) -> str:
    return dfmt.shared_sha256({k: np.asarray(v) for k, v in flatten(params).items()})


def _quiet_orbax() -> None:
    dfmt._quiet_orbax()


class RunDir:
    """The output directory of a run: metadata, step log, orbax states, best export."""

    def __init__(self, out: str | os.PathLike, keep: int = 2):
        self.path = Path(out)
        self.meta_path = self.path / dfmt.DRAFT_META
        self.log_path = self.path / "train_log.jsonl"
        self.state_dir = self.path / dfmt.STATE_DIR
        self.best_dir = self.path / dfmt.BEST_DIR
        self.keep = keep
        self._mngr = None

    def has_run(self) -> bool:
        return self.meta_path.exists() or self.state_dir.exists()

    @property
    def manager(self):
        if self._mngr is None:
            import orbax.checkpoint as ocp

            _quiet_orbax()
            opts = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, enable_async_checkpointing=False, cleanup_tmp_directories=True, create=True
            )
            self._mngr = ocp.CheckpointManager(self.state_dir.absolute(), options=opts)
        return self._mngr

    def save(self, step: int, params, opt_state) -> None:
        import orbax.checkpoint as ocp

        self.manager.save(
            step,
            args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state)),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore_latest(self, params, opt_state) -> tuple[int, Any, Any] | None:
        """(step, params, opt_state) of the newest step that restores, or None if there is none."""
        import jax
        import orbax.checkpoint as ocp

        abs_p = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
        abs_o = jax.tree.map(ocp.utils.to_shape_dtype_struct, opt_state)
        damaged = []
        for s in dfmt.complete_steps(self.state_dir):
            try:
                r = self.manager.restore(
                    s,
                    args=ocp.args.Composite(params=ocp.args.StandardRestore(abs_p), opt_state=ocp.args.StandardRestore(abs_o)),
                )
            except Exception as e:  # a damaged step: fall back to the one before
                _log(f"state step {s} does not restore ({type(e).__name__}: {str(e).splitlines()[0][:160]}); trying older")
                damaged.append(s)
                continue
            for d in damaged:  # newer than the restored step and unusable: they would block re-saving
                shutil.rmtree(self.state_dir / str(d), ignore_errors=True)
            if damaged:
                self.manager.reload()
            return s, r["params"], r["opt_state"]
        return None

    def export(self, dest: Path, params, meta: dict[str, Any]) -> None:
        """Write a params-only draft (draft.json + params/) to ``dest`` atomically (tmp dir + rename)."""
        import orbax.checkpoint as ocp

        _quiet_orbax()
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            with ocp.StandardCheckpointer() as ck:
                ck.save((tmp / dfmt.PARAMS_DIR).absolute(), params)
                ck.wait_until_finished()
            dfmt.write_json_atomic(tmp / dfmt.DRAFT_META, meta)
            old = None
            if dest.exists():
                old = dest.parent / f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                os.rename(dest, old)
            os.rename(tmp, dest)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def recover_best(self) -> None:
        """A kill between the two renames of :meth:`export` leaves only ``.best.old-*``: put it back."""
        if self.best_dir.exists():
            for p in self.path.glob(f".{dfmt.BEST_DIR}.*"):
                shutil.rmtree(p, ignore_errors=True)
            return
        olds = sorted(self.path.glob(f".{dfmt.BEST_DIR}.old-*"))
        if olds and dfmt.is_draft_dir(olds[-1]):
            os.rename(olds[-1], self.best_dir)
        for p in self.path.glob(f".{dfmt.BEST_DIR}.*"):
            shutil.rmtree(p, ignore_errors=True)

    def append_log(self, rec: dict[str, Any]) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def truncate_log(self, step: int) -> None:
        if not self.log_path.exists():
            return
        keep = []
        with open(self.log_path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= step:
                        keep.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    break  # a line cut by a kill ends the usable log
        tmp = self.log_path.with_name(f".{self.log_path.name}.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, self.log_path)

    def close(self) -> None:
        if self._mngr is not None:
            self._mngr.close()
            self._mngr = None


# ------------------------------------------------------------------------------- the run
def _log(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in d.items()}


def _resume_check(meta: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    diffs = []
    if meta["target"].get("weights_sha256") != new["target"]["weights_sha256"]:
        diffs.append(f"target ({meta['target'].get('name')} -> {new['target']['name']})")
    if meta.get("config") != new["config"]:
        diffs.append("draft config (--size)")
    old_args = meta.get("train", {}).get("args", {})
    for k in _RESUME_KEYS:
        if old_args.get(k) != new["train"]["args"][k]:
            diffs.append(f"--{k.replace('_', '-')} ({old_args.get(k)} -> {new['train']['args'][k]})")
    old_data = meta.get("train", {}).get("data", {}).get("train", {}).get("sha256")
    if not diffs and old_data and old_data != new["train"]["data"]["train"]["sha256"]:
        diffs.append("training data (the tokenized stream changed)")
    if diffs:
        raise UserError(f"cannot resume {path}: it was trained with a different {', '.join(diffs)}")


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
        raise UserError(f"{run.path} already holds a training run: pass --resume to continue it or choose another --out")

    target = load_model(args.target, dtype=args.dtype)
    tcfg = target.cfg
    cfg, law = size_draft(tcfg, args.size)
    init_idx = init_layer_indices(args.init_layers, tcfg.num_layers, cfg.num_layers)
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
            "args": {k: getattr(args, k) for k in (*_RESUME_KEYS, "target", "size", "eval_every", "eval_windows", "save_every")},
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
            _log(f"resuming {run.path} from step {start}")
        else:
            _log(f"no complete checkpoint in {run.path}: starting from step 0")
        run.truncate_log(start)
    else:
        if run.log_path.exists():
            run.log_path.unlink()
    dfmt.write_json_atomic(run.meta_path, meta)
    _log(
        f"draft: {cfg.num_layers} layers x {cfg.hidden_size} (init from target layers {init_idx}), "
        f"N = {pr['N']:,} trained + {pr['shared']:,} shared; SDSL N_opt = {law['n_opt']:.3g} "
        f"for M = {law['M']:,}; per-token cost {pr['cost_ratio']:.2f}x the target's"
    )

    train_step = make_train_step(cfg, tcfg, args.loss, opt)
    eval_fn = make_eval_step(cfg, tcfg)
    evb = eval_batches(corpus.heldout, _eval_batches(args), args.batch_size, args.seq_len)
    frozen_step = frozen if args.loss != "ce" else {"shared": frozen["shared"], "target": None}

    def do_eval(step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        m = evaluate(eval_fn, params, frozen, evb)
        m = {"step": step, **m, "eval_s": time.perf_counter() - t0}
        meta["evals"].append(_finite(m))
        _log(
            f"eval step {step}: ppl {m['ppl']:.3f} (target {m['target_ppl']:.3f}), alpha {m['alpha']:.4f}, "
            f"greedy match {m['greedy_match']:.4f}, kl {m['kl']:.4f}  [{m['eval_s']:.1f}s]"
        )
        return m

    def export_best(step: int, m: dict[str, Any]) -> None:
        best = meta.get("best")
        if best is not None and best.get("alpha") is not None and m["alpha"] <= best["alpha"]:
            return
        meta["best"] = {"step": step, **_finite({k: m[k] for k in ("alpha", "greedy_match", "ppl", "target_ppl", "kl")})}
        bmeta = {**meta, "step": step, "metrics": _finite(m), "params_sha256": tensors_sha256(params)}
        bmeta.pop("evals", None)
        run.export(run.best_dir, params, bmeta)

    due = start == args.steps or (bool(args.eval_every) and start % args.eval_every == 0)
    if due and not any(e["step"] == start for e in meta["evals"]):
        # step 0, or a kill between saving an eval step's state and recording its evaluation
        export_best(start, do_eval(start))
        dfmt.write_json_atomic(run.meta_path, meta)

    tokens_per_step = args.batch_size * args.seq_len
    bar = progress(total=args.steps, initial=start, desc="train", unit="step", leave=True, mininterval=1.0)
    t_first = None
    times: list[float] = []
    last_eval = meta["evals"][-1] if meta["evals"] else None
    try:
        for step in range(start, args.steps):
            batch = train_batch(corpus.train, step, args.seed, args.batch_size, args.seq_len)
            t0 = time.perf_counter()
            params, opt_state, metrics = train_step(params, opt_state, batch, frozen_step)
            metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
            dt = time.perf_counter() - t0
            if t_first is None:
                t_first = dt
            else:
                times.append(dt)
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
            post = f"loss {metrics['loss']:.4f}" + (f" a {metrics['alpha']:.3f}" if "alpha" in metrics else "")
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
            "device": str(jax.devices()[0].platform),
        }
        meta.setdefault("timing_history", []).append(timing)
        try:
            dfmt.write_json_atomic(run.meta_path, meta)
        except OSError:
            pass
        run.close()
    return {"out": str(run.path), "step": meta["step"], "eval": last_eval, "best": meta["best"], "timing": timing, "meta": meta}


# ------------------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage block too)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    d = TrainArgs(target="")
    p = _Parser(prog="python -m ssd_jax.train", description="Train an SDSL-sized draft model for a target.")
    p.add_argument("--target", required=True, help="registry name, .gguf file, HF or converted directory")
    p.add_argument("--size", default=d.size, help="'auto' (SDSL N_opt) or the draft's non-embedding parameters, e.g. 10M")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window")
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps, at most 100)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip", type=float, default=d.clip, help="global gradient-norm clip")
    p.add_argument("--loss", choices=LOSSES, default=d.loss, help="ce, kl (distillation from the target) or mix")
    p.add_argument("--seed", type=int, default=d.seed, help="data order seed")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between evaluations (0: at the end)")
    p.add_argument("--eval-windows", type=int, default=d.eval_windows, help="held-out windows per evaluation")
    p.add_argument("--save-every", type=int, default=None, help="steps between saves (default: each evaluation)")
    p.add_argument("--keep", type=int, default=d.keep, help="training states kept")
    p.add_argument("--init-layers", default=d.init_layers, help="spread, first, none or target layer indices (0,15,29)")
    p.add_argument("--data", default=d.data, help="'corpus' (shipped prompt sets) or a .txt/.jsonl file")
    p.add_argument("--out", default=None, help="output directory (default checkpoints/<target>-draft)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def run_cli(argv=None) -> int:
    a = build_parser().parse_args(argv)
    args = TrainArgs(
        target=a.target, size=a.size, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
        warmup=a.warmup, weight_decay=a.weight_decay, clip=a.clip, loss=a.loss, seed=a.seed,
        eval_every=a.eval_every, eval_windows=a.eval_windows, save_every=a.save_every, keep=a.keep,
        init_layers=a.init_layers, data=a.data, out=a.out, resume=a.resume,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda msg, *_a, **_k: print(f"warning: {msg}", file=sys.stderr)
        s = train(args)
    summary = {k: s[k] for k in ("out", "step", "eval", "best", "timing")}
    if a.json:
        print(json.dumps(summary))
        return 0
    t, e, b = s["timing"], s["eval"], s["best"]
    print(f"draft saved in {s['out']} (step {s['step']}); load it with --draft {s['out']}")
    if e:
        print(f"final eval: ppl {e['ppl']:.3f} (target {e['target_ppl']:.3f}), alpha {e['alpha']:.4f}, "
              f"greedy match {e['greedy_match']:.4f}")
    if b:
        print(f"best by alpha: step {b['step']}, alpha {b['alpha']:.4f} -> {Path(s['out']) / dfmt.BEST_DIR}")
    if t["step_s"]:
        print(f"speed: {1 / t['step_s']:.3f} steps/s, {t['tokens_per_s']:,.0f} tokens/s "
              f"(first step incl. compile {t['first_step_s']:.1f}s, {t['steps']} timed steps)")
    return 0


def main(argv=None) -> int:
    from ssd_jax.errors import cli_main

    return cli_main(run_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
