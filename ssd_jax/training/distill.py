"""Training on stored target distributions (``--loss distill --data DIR``, DIR from ``distill-data``).

Batches
-------
One example is one sequence (prompt + the target's continuation), right-padded to ``seq_len + 1``
tokens (a longer one keeps its last ``seq_len + 1`` tokens, so the continuation stays and the
prompt loses its start). Sequences are not packed: the draft sees exactly the context the target
was scored with. Example ``step·B + b`` is entry ``(step·B + b) mod n`` of a permutation seeded
by (seed, epoch), so the order is a pure function of (seed, step) and a resumed run sees the same
batches. Only positions that predict a generated token carry a loss (``mask``).

Loss
----
At each such position the stored top-k of the target, ``p_1..p_k`` (real log-probabilities, not
renormalised), against the draft's ``q = softmax(z)``:

* ``tail="bucket"`` (default): the KL between the two distributions coarsened to the k tokens plus
  one "everything else" bucket, ``sum_i p_i log(p_i / q_i) + p_t log(p_t / q_t)`` with
  ``p_t = 1 - sum_i p_i`` and ``q_t = 1 - sum_i q_i`` (computed as a log-sum-exp over the tokens
  outside the top-k, so it stays accurate when small). It is exactly the full KL when the tail is
  empty and a lower bound on it otherwise (the log-sum inequality), and it asks the draft to put
  the target's tail mass outside the top-k without saying where.
* ``tail="renorm"``: the top-k renormalised, ``p~_i = p_i / sum_j p_j``, and
  ``sum_i p~_i log(p~_i / q_i)`` (the draft is pushed to put all its mass on the top-k).

With ``ce_weight = W`` the loss is ``(1 - W)·KL + W·CE``, CE the cross-entropy of the stored
token (the target's own sample: its argmax at T = 0). ``alpha_topk = sum_i min(p_i, q_i)`` is
logged: a lower bound of the acceptance ``alpha = sum_x min(p, q)`` at temperature 1.

Trimmed head (``draft_vocab = N``): the draft's logits outside the kept ids (the same ids
``--draft-vocab N`` keeps at decode time, :mod:`ssd_jax.drafters.vocab`) are masked before the
softmax, so training sees the q that decoding will sample from. Target mass on tokens the draft
cannot propose moves into the tail bucket (``bucket``) or is dropped before renormalising
(``renorm``); CE skips positions whose token is not kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ssd_jax.models.config import ModelConfig
from ssd_jax.training.args import TAILS
from ssd_jax.training.distill_data import DistillData
from ssd_jax.training.objective import MASKED_LOGIT, mask_head

__all__ = ["TAILS", "distill_batch", "distill_loss", "distill_stats", "make_distill_step", "mask_head"]
_MASKED = MASKED_LOGIT


@functools.lru_cache(maxsize=4)
def _perm(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 7]).permutation(n)


def distill_batch(data: DistillData, step: int, seed: int, batch: int, seq_len: int) -> dict[str, np.ndarray]:
    """The examples of ``step``: ``tokens (B, L+1)``, ``topk_ids / topk_logprobs (B, L, K)`` for the
    token each input position predicts, ``mask (B, L)`` (1 where that token was generated)."""
    K = data.topk_ids.shape[1]
    tokens = np.zeros((batch, seq_len + 1), np.int32)
    ids = np.zeros((batch, seq_len, K), np.int32)
    lps = np.zeros((batch, seq_len, K), np.float32)
    lps[...] = -np.log(K)  # harmless values where mask = 0
    mask = np.zeros((batch, seq_len), np.float32)
    n = data.n
    for b in range(batch):
        g = step * batch + b
        e = int(_perm(seed, g // n, n)[g % n])
        lo, hi = int(data.offsets[e]), int(data.offsets[e + 1])
        start = max(lo, hi - (seq_len + 1))
        seq = data.tokens[start:hi]
        tokens[b, : len(seq)] = seq
        p_abs = lo + int(data.prompt_lens[e])  # first generated token
        first = max(p_abs, start + 1)  # first generated token predicted inside the window
        if first >= hi:
            continue
        rows = slice(int(data.gen_offsets[e]) + first - p_abs, int(data.gen_offsets[e]) + hi - p_abs)
        pos = slice(first - start - 1, hi - start - 1)  # input positions predicting them
        ids[b, pos] = data.topk_ids[rows]
        lps[b, pos] = data.topk_logprobs[rows]
        mask[b, pos] = 1.0
    return {"tokens": tokens, "topk_ids": ids, "topk_logprobs": lps, "mask": mask}


def distill_stats(logits_q_BxTxV, topk_ids_BxTxK, topk_lp_BxTxK, labels_BxT, head_mask_V=None, tail: str = "bucket"):
    """Per-position ``kl``, ``ce`` (the label's), ``ce_ok`` (label kept by the head) and ``alpha_topk``."""
    import jax
    import jax.numpy as jnp

    z = mask_head(logits_q_BxTxV.astype(jnp.float32), head_mask_V)
    lq = jax.nn.log_softmax(z, axis=-1)
    lq_k = jnp.take_along_axis(lq, topk_ids_BxTxK, axis=-1)
    lp_k = topk_lp_BxTxK.astype(jnp.float32)
    kept = jnp.ones_like(lp_k, bool) if head_mask_V is None else head_mask_V[topk_ids_BxTxK]
    lp_kept = jnp.where(kept, lp_k, -jnp.inf)
    p_k = jnp.exp(lp_kept)
    term = jnp.where(kept, p_k * (lp_k - lq_k), 0.0)
    if tail == "renorm":
        lpn = lp_kept - jax.scipy.special.logsumexp(lp_kept, axis=-1, keepdims=True)
        kl = jnp.sum(jnp.where(kept, jnp.exp(lpn) * (lpn - lq_k), 0.0), axis=-1)
    else:
        # the tails: the target's mass off the kept top-k; the draft's mass off the top-k (masked ids
        # have q = 0 already)
        log_pt = jnp.log(jnp.clip(-jnp.expm1(jax.scipy.special.logsumexp(lp_kept, axis=-1)), 1e-30, 1.0))
        B, T, K = topk_ids_BxTxK.shape
        off = lq.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], topk_ids_BxTxK].set(-jnp.inf)
        log_qt = jnp.maximum(jax.scipy.special.logsumexp(off, axis=-1), _MASKED)
        pt = jnp.exp(log_pt)
        kl = jnp.sum(term, axis=-1) + jnp.where(pt > 1e-12, pt * (log_pt - log_qt), 0.0)
    ce = -jnp.take_along_axis(lq, labels_BxT[..., None], axis=-1)[..., 0]
    ce_ok = jnp.ones_like(ce, bool) if head_mask_V is None else head_mask_V[labels_BxT]
    alpha = jnp.sum(jnp.minimum(p_k, jnp.exp(lq_k)), axis=-1)
    return {"kl": kl, "ce": jnp.where(ce_ok, ce, 0.0), "ce_ok": ce_ok, "alpha_topk": alpha}


def distill_loss(stats, mask_BxT, ce_weight: float):
    """``(1 - W)·mean KL + W·mean CE`` over the masked positions; returns (loss, kl, ce)."""
    import jax.numpy as jnp

    m = mask_BxT.astype(jnp.float32)
    kl = jnp.sum(stats["kl"] * m) / jnp.maximum(jnp.sum(m), 1.0)
    mc = m * stats["ce_ok"]
    ce = jnp.sum(stats["ce"] * mc) / jnp.maximum(jnp.sum(mc), 1.0)
    return (1.0 - ce_weight) * kl + ce_weight * ce, kl, ce


@functools.lru_cache(maxsize=8)
def make_distill_step(cfg: ModelConfig, tail: str, ce_weight: float, optimizer) -> Callable:
    """One jitted step ``(params, opt_state, batch, frozen) -> (params, opt_state, metrics)`` on a
    :func:`distill_batch` (``frozen`` = {"shared", optional "head_mask"}); params and state donated."""
    import jax
    import optax

    from ssd_jax.training.objective import causal_logits, global_norm

    def step(params, opt_state, batch, frozen):
        tokens, labels = batch["tokens"][:, :-1], batch["tokens"][:, 1:]

        def loss_fn(p):
            z = causal_logits({**frozen["shared"], **p}, cfg, tokens)
            st = distill_stats(z, batch["topk_ids"], batch["topk_logprobs"], labels, frozen.get("head_mask"), tail)
            loss, kl, ce = distill_loss(st, batch["mask"], ce_weight)
            return loss, (kl, ce, st["alpha_topk"])

        (loss, (kl, ce, alpha)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        m = batch["mask"]
        metrics = {"loss": loss, "kl": kl, "ce": ce, "grad_norm": global_norm(grads),
                   "alpha": (alpha * m).sum() / jax.numpy.maximum(m.sum(), 1.0), "tokens": m.sum()}
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))
