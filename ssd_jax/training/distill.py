"""Training on stored target distributions (``--loss distill --data DIR``, DIR from ``distill-data``).

Batches
-------
A window is ``seq_len + 1`` tokens; a sequence (prompt + the target's continuation) longer than that
keeps its last ``seq_len + 1`` tokens, so the continuation stays and the prompt loses its start.
Only input positions that predict a generated token of their own sequence carry a loss (``mask``).

* Unpacked (default): one sequence per window, right-padded. Window ``g = step·B + b`` is entry
  ``g mod n`` of a permutation seeded by (seed, epoch ``g div n``).
* Packed (``pack=True``, ``--pack``): the sequences of an epoch, in the order of the same
  permutation, go first-fit into windows (:func:`pack_epoch`). For SmolLM2's data (sequences of
  ~230 tokens, half of them prompt) an unpacked 513-token window is 54% padding; packed windows hold
  1.9 sequences and are 86% full, and a step trains 1.9x the tokens with a loss at the same cost. Each sequence keeps its own positions (restarting at 0) and a
  segment id; attention is causal AND within the segment (:func:`ssd_jax.training.objective.causal_logits`),
  so every sequence's logits are those of the sequence alone and the loss is the unpacked loss over
  the same sequences. Window ``g`` is row ``g`` of the epochs' plans laid end to end.

Either way the windows of a step are a pure function of (data, seed, step): a resumed run sees the
same batches (the packed plans are recomputed from epoch 0, a few ms each, and cached on the data).

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

__all__ = [
    "TAILS",
    "batch_rows",
    "distill_batch",
    "distill_loss",
    "distill_stats",
    "fill_rows",
    "make_distill_step",
    "mask_head",
    "pack_epoch",
]
_MASKED = MASKED_LOGIT


@functools.lru_cache(maxsize=4)
def _perm(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 7]).permutation(n)


def _window_lens(data: DistillData, seq_len: int) -> np.ndarray:
    return np.minimum(np.diff(data.offsets), seq_len + 1)


def pack_epoch(data: DistillData, seed: int, epoch: int, seq_len: int) -> list[list[int]]:
    """The rows of one packed epoch: every sequence once, in the order of the epoch's permutation,
    each put into the first row with room left for its window (first fit, rows of ``seq_len + 1``)."""
    lens = _window_lens(data, seq_len)
    room = np.zeros(data.n, np.int64)
    rows: list[list[int]] = []
    for e in _perm(seed, epoch, data.n):
        n = int(lens[e])
        r = int(np.argmax(room[: len(rows)] >= n)) if rows and room[: len(rows)].max() >= n else len(rows)
        if r == len(rows):
            rows.append([])
            room[r] = seq_len + 1
        rows[r].append(int(e))
        room[r] -= n
    return rows


def _packed_row(data: DistillData, seed: int, g: int, seq_len: int) -> list[int]:
    """Row ``g`` of the packed stream: the epochs' rows one after another (plans cached on ``data``)."""
    plans = data.cache.setdefault(("pack", seed, seq_len), [])
    epoch = 0
    while True:
        if epoch == len(plans):
            plans.append(pack_epoch(data, seed, epoch, seq_len))
        if g < len(plans[epoch]):
            return plans[epoch][g]
        g -= len(plans[epoch])
        epoch += 1


def batch_rows(
    data: DistillData, step: int, seed: int, batch: int, seq_len: int, pack: bool
) -> list[list[int]]:
    """The sequences of each row of ``step``: global row ``g = step·B + b`` is entry ``g mod n`` of
    the permutation of epoch ``g div n`` (one sequence a row), or (``pack``) row ``g`` of the
    concatenated packed epochs. Either way a pure function of (data, seed, step)."""
    rows = range(step * batch, (step + 1) * batch)
    if pack:
        return [_packed_row(data, seed, g, seq_len) for g in rows]
    return [[int(_perm(seed, g // data.n, data.n)[g % data.n])] for g in rows]


def fill_rows(data: DistillData, rows: list[list[int]], seq_len: int) -> dict[str, np.ndarray]:
    """The batch of ``rows`` (sequence ids per row): ``tokens (B, L+1)``; for the L input positions
    ``positions`` and ``segments (B, L)`` (position in its sequence, restarting at 0; segment 1, 2,
    ... per sequence, 0 for padding), ``topk_ids / topk_logprobs (B, L, K)`` for the token each
    predicts and ``mask (B, L)`` (1 where that is a generated token of the same sequence)."""
    K = data.topk_ids.shape[1]
    B = len(rows)
    tokens = np.zeros((B, seq_len + 1), np.int32)
    positions = np.zeros((B, seq_len + 1), np.int32)
    segments = np.zeros((B, seq_len + 1), np.int32)
    ids = np.zeros((B, seq_len, K), np.int32)
    lps = np.full((B, seq_len, K), -np.log(K), np.float32)  # harmless values where mask = 0
    mask = np.zeros((B, seq_len), np.float32)
    for b, members in enumerate(rows):
        o = 0  # where the next sequence starts in the row
        for j, e in enumerate(members):
            lo, hi = int(data.offsets[e]), int(data.offsets[e + 1])
            start = max(lo, hi - (seq_len + 1))  # a long sequence keeps its last L + 1 tokens
            n = hi - start
            tokens[b, o : o + n] = data.tokens[start:hi]
            positions[b, o : o + n] = np.arange(n)
            segments[b, o : o + n] = j + 1
            p_abs = lo + int(data.prompt_lens[e])  # first generated token
            first = max(p_abs, start + 1)  # first generated token predicted inside the window
            if first < hi:
                rows_k = slice(
                    int(data.gen_offsets[e]) + first - p_abs, int(data.gen_offsets[e]) + hi - p_abs
                )
                pos = slice(o + first - start - 1, o + hi - start - 1)  # input positions predicting them
                ids[b, pos] = data.topk_ids[rows_k]
                lps[b, pos] = data.topk_logprobs[rows_k]
                mask[b, pos] = 1.0
            o += n
    return {
        "tokens": tokens,
        "positions": positions[:, :-1],
        "segments": segments[:, :-1],
        "topk_ids": ids,
        "topk_logprobs": lps,
        "mask": mask,
    }


def distill_batch(
    data: DistillData, step: int, seed: int, batch: int, seq_len: int, pack: bool = False
) -> dict[str, np.ndarray]:
    """The examples of ``step`` (:func:`batch_rows`, :func:`fill_rows`)."""
    return fill_rows(data, batch_rows(data, step, seed, batch, seq_len, pack), seq_len)


def distill_stats(
    logits_q_BxTxC,
    topk_ids_BxTxK,
    topk_lp_BxTxK,
    labels_BxT,
    head_mask_V=None,
    tail: str = "bucket",
    col_of_V=None,
):
    """Per-position ``kl``, ``ce`` (the label's), ``ce_ok`` (label kept by the head) and ``alpha_topk``.

    The draft's logits come in one of three forms:

    * full head: ``(B, T, V)``, both maps None;
    * trimmed by a mask: ``(B, T, V)`` and ``head_mask_V`` (V,) bool, the ids the head keeps;
    * trimmed by gathering (what training steps use): ``(B, T, N)``, the logits of the kept ids
      only (:func:`ssd_jax.training.objective.kept_logits`), and ``col_of_V`` (V,) int32, each
      id's column there or -1. Same statistics as the mask form, at N/V of the cost.
    """
    import jax
    import jax.numpy as jnp

    z = logits_q_BxTxC.astype(jnp.float32)
    if head_mask_V is not None:
        z = mask_head(z, head_mask_V)
        col_of_V = jnp.where(head_mask_V, jnp.arange(head_mask_V.shape[0], dtype=jnp.int32), -1)
    C = z.shape[-1]
    lq = jax.nn.log_softmax(z, axis=-1)
    if col_of_V is None:
        cols, lcol = topk_ids_BxTxK, labels_BxT
        kept, ce_ok = jnp.ones(cols.shape, bool), jnp.ones(lcol.shape, bool)
    else:
        cols, lcol = col_of_V[topk_ids_BxTxK], col_of_V[labels_BxT]
        kept, ce_ok = cols >= 0, lcol >= 0
        cols, lcol = jnp.maximum(cols, 0), jnp.maximum(lcol, 0)
    lq_k = jnp.take_along_axis(lq, cols, axis=-1)
    lp_k = topk_lp_BxTxK.astype(jnp.float32)
    lp_kept = jnp.where(kept, lp_k, -jnp.inf)
    p_k = jnp.exp(lp_kept)
    term = jnp.where(kept, p_k * (lp_k - lq_k), 0.0)
    if tail == "renorm":
        lpn = lp_kept - jax.scipy.special.logsumexp(lp_kept, axis=-1, keepdims=True)
        kl = jnp.sum(jnp.where(kept, jnp.exp(lpn) * (lpn - lq_k), 0.0), axis=-1)
    else:
        # the tails: the target's mass off the kept top-k; the draft's mass off the top-k (ids the
        # head drops have q = 0 already)
        log_pt = jnp.log(jnp.clip(-jnp.expm1(jax.scipy.special.logsumexp(lp_kept, axis=-1)), 1e-30, 1.0))
        B, T, K = cols.shape
        at = jnp.where(kept, cols, C)  # out of range: dropped
        off = lq.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], at].set(-jnp.inf, mode="drop")
        log_qt = jnp.maximum(jax.scipy.special.logsumexp(off, axis=-1), _MASKED)
        pt = jnp.exp(log_pt)
        kl = jnp.sum(term, axis=-1) + jnp.where(pt > 1e-12, pt * (log_pt - log_qt), 0.0)
    ce = -jnp.take_along_axis(lq, lcol[..., None], axis=-1)[..., 0]
    alpha = jnp.sum(jnp.where(kept, jnp.minimum(p_k, jnp.exp(lq_k)), 0.0), axis=-1)
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
    :func:`distill_batch` (``frozen`` = {"shared", optional "head_ids" (N,) and "head_col" (V,) of a
    trimmed head}); params and state donated."""
    import jax
    import optax

    from ssd_jax.models import llama

    from ssd_jax.training.objective import causal_hidden, global_norm, kept_logits

    def step(params, opt_state, batch, frozen):
        tokens, labels = batch["tokens"][:, :-1], batch["tokens"][:, 1:]

        def loss_fn(p):
            full = {**frozen["shared"], **p}
            h = causal_hidden(full, cfg, tokens, batch["positions"], batch["segments"])
            if "head_ids" in frozen:  # a trimmed head: only its N rows are computed
                z = kept_logits(full, cfg, h, frozen["head_ids"])
                st = distill_stats(
                    z, batch["topk_ids"], batch["topk_logprobs"], labels, None, tail, frozen["head_col"]
                )
            else:
                st = distill_stats(
                    llama.logits(full, cfg, h), batch["topk_ids"], batch["topk_logprobs"], labels, None, tail
                )
            loss, kl, ce = distill_loss(st, batch["mask"], ce_weight)
            return loss, (kl, ce, st["alpha_topk"])

        (loss, (kl, ce, alpha)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        m = batch["mask"]
        metrics = {
            "loss": loss,
            "kl": kl,
            "ce": ce,
            "grad_norm": global_norm(grads),
            "alpha": (alpha * m).sum() / jax.numpy.maximum(m.sum(), 1.0),
            "tokens": m.sum(),
        }
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))
