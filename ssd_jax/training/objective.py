"""What a step computes: the causal forward, the losses and statistics, the optimiser, and the jitted
train and eval steps (cached by configuration, so equal runs share compiled code)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ssd_jax.models.config import ModelConfig
from ssd_jax.training.args import TrainArgs


def causal_logits(params, cfg: ModelConfig, tokens_BxT, positions_BxT=None, segments_BxT=None):
    """Logits of a causal pass over whole sequences (the shared forward, with a fresh KV cache).

    Packed rows: ``positions_BxT`` are each token's RoPE position in its own sequence and
    ``segments_BxT`` its sequence's id in the row; a token then attends to the earlier tokens of its
    own segment only, so each sequence's logits are those of the sequence alone.
    """
    from ssd_jax.models import llama

    return llama.logits(params, cfg, causal_hidden(params, cfg, tokens_BxT, positions_BxT, segments_BxT))


def causal_hidden(params, cfg: ModelConfig, tokens_BxT, positions_BxT=None, segments_BxT=None):
    """The final hidden states of :func:`causal_logits` (before the output head)."""
    import jax.numpy as jnp

    from ssd_jax.models import llama

    B, T = tokens_BxT.shape
    mask_BxTxT = None
    if segments_BxT is not None:
        same_BxTxT = segments_BxT[:, :, None] == segments_BxT[:, None, :]
        mask_BxTxT = same_BxTxT & jnp.tril(jnp.ones((T, T), bool))[None]
    hidden_BxTxD, _ = llama.forward(
        params,
        cfg,
        tokens_BxT,
        llama.init_cache(cfg, B, T),
        positions_BxT=positions_BxT,
        mask_BxTxS=mask_BxTxT,
    )
    return hidden_BxTxD


def kept_logits(params, cfg: ModelConfig, hidden_BxTxD, head_ids_N):
    """Logits of the ``head_ids_N`` rows of the output head only, ``(B, T, N)`` in float32.

    A trimmed head trained this way costs N/V of the full head's matmul, and every (B, T, .) array
    of the loss is N wide instead of V (for SmolLM2 at N = 4096: 12x less)."""
    from ssd_jax.models import llama

    return llama.kept_logits(params, cfg, hidden_BxTxD, head_ids_N)


MASKED_LOGIT = -1e30  # logit of a token outside a trimmed head: q = 0 there, and no inf - inf


def mask_head(logits_BxTxV, head_mask_V):
    """Logits of a head trimmed to the ids where ``head_mask_V`` is true (None: the full head)."""
    import jax.numpy as jnp

    if head_mask_V is None:
        return logits_BxTxV
    return jnp.where(head_mask_V, logits_BxTxV, MASKED_LOGIT)


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


def global_norm(tree):
    import optax

    tree_norm = getattr(
        getattr(optax, "tree", None), "norm", None
    )  # optax >= 0.2.5; global_norm is deprecated
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
        metrics = {"loss": loss, "grad_norm": global_norm(grads), "ce": stats["ce"].mean()}
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
        q = mask_head(causal_logits({**frozen["shared"], **params}, cfg, tokens), frozen.get("head_mask"))
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
