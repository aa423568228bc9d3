"""Speculative verification: exact rejection sampling over a batch, one compiled program.

Given the target's raw logits at the K+1 positions of a round and the K draft proposals,
:func:`verify` decides per row how many proposals are accepted and draws the token that
follows them (the "bonus" / correction token). Everything is static-shape and free of Python
control flow on traced values, so it can live inside the jitted SD / SSD round.

Rules (docs/reference.md §1), per row b, with p_j = exp(filter_logprobs(target_logits[:, j])):

* Greedy rows (temperature 0): accept s_j while s_j == argmax(raw target logits at j) (ties
  to the lowest id, as :func:`ssd_jax.sampling.sample`); the next token is the argmax at the
  first mismatch, or at position n_draft if every proposal matched.
* Sampled rows, proposals drawn from a distribution q_j (``draft_logprobs`` given): accept
  s_j with probability min(1, p_j(s_j) / q_j(s_j)); at the first rejection draw from the
  residual normalise(max(0, p_j - q_j)); if all n_draft proposals are accepted draw from
  p at position n_draft.
* Sampled rows, point-mass proposals (``draft_logprobs=None``: n-gram, random tokens, a
  cache entry without q): this is the rule above with q_j = one_hot(s_j), i.e. accept with
  probability p_j(s_j) and on rejection draw from p_j with s_j removed and renormalised.
  It is exact whatever produced the proposal (it need not be random at all).
* A proposal with q_j(s_j) == 0 cannot have been drawn from q_j (or its probability
  underflowed in float32), so it is verified by the point-mass rule instead. The point-mass
  rule is exact conditionally on any proposal, so this keeps the output distribution p (the
  only approximation is the underflowed mass itself, < 1e-38). A caller with a batch that
  mixes q-proposals and point-mass proposals can therefore mark point-mass positions by
  setting their log-probabilities to -inf (see :func:`mark_point_mass`).
* If the residual is numerically empty (p <= q everywhere; only possible through float
  rounding, since a rejection implies p(s) < q(s) hence positive residual mass) the draw
  falls back to p.

Why it is exact: for one position the probability that x is emitted first is
q(x)·min(1, p(x)/q(x)) + (1 - Σ_y min(p(y), q(y)))·residual(x) = min(p, q)(x) + max(0, p - q)(x)
= p(x). Chaining positions gives the target's joint distribution (tests/test_verify.py checks
both analytically and by Monte Carlo).

Randomness: one block of K + V independent uniforms per row (K acceptance tests, then the
Gumbel noise of the bonus draw), so rows are independent. ``key`` is either one key (the
block is drawn for the whole batch) or a (B,) batch of row keys (each row's draws then
depend only on its own key, not on the batch it rides in).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ssd_jax.sampling.filters import RowSampling, filter_logprobs, fold_in, is_key_batch

__all__ = [
    "VerifyResult",
    "acceptance_prob",
    "emitted_tokens",
    "expected_acceptance",
    "is_key_batch",
    "mark_point_mass",
    "next_token_logprobs",
    "residual_distribution",
    "row_keys",
    "verify",
    "verify_greedy",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyResult:
    """Outcome of one verification round, per row.

    Attributes:
      n_accepted: (B,) int32, draft tokens accepted, 0..n_draft[b].
      next_token: (B,) int32, the bonus / correction token emitted after the accepted ones.
        A row always emits n_accepted + 1 tokens.
      accepted_BxK: (B, K) bool, True exactly at positions j < n_accepted[b].
    """

    n_accepted: jax.Array
    next_token: jax.Array
    accepted_BxK: jax.Array


# --------------------------------------------------------------------------- helpers


def _take_last(x_NxV: jax.Array, idx_N: jax.Array) -> jax.Array:
    """x[..., idx] along the last axis for matching leading shapes."""
    return jnp.take_along_axis(x_NxV, idx_N[..., None], axis=-1)[..., 0]


def _accept_prob_from_values(p_s: jax.Array, q_s: jax.Array | None) -> jax.Array:
    """min(1, p(s)/q(s)); the point-mass rule (accept with prob p(s)) where q is None or q(s) == 0."""
    p_s = jnp.clip(p_s, 0.0, 1.0)
    if q_s is None:
        return p_s
    has_q = q_s > 0
    ratio = p_s / jnp.where(has_q, q_s, 1.0)
    return jnp.where(has_q, jnp.minimum(ratio, 1.0), p_s)


def acceptance_prob(p_xV: jax.Array, q_xV: jax.Array | None, tokens_x: jax.Array) -> jax.Array:
    """Probability that proposal ``tokens`` is accepted, min(1, p(s)/q(s)), in [0, 1].

    ``p`` and ``q`` are probabilities of shape (..., V), ``tokens`` has shape (...). With
    ``q=None`` (or where q(s) == 0) the proposal is a point mass and the probability is p(s).
    """
    p_s = _take_last(p_xV.astype(jnp.float32), tokens_x)
    q_s = None if q_xV is None else _take_last(q_xV.astype(jnp.float32), tokens_x)
    return _accept_prob_from_values(p_s, q_s)


def residual_distribution(p_xV: jax.Array, q_xV: jax.Array) -> jax.Array:
    """normalise(max(0, p - q)) over the last axis; falls back to p where that mass is 0.

    For a point-mass proposal s pass ``q = one_hot(s)``: the result is p with s removed and
    renormalised (and p itself when p(s) == 1, where a rejection cannot happen).
    """
    p = p_xV.astype(jnp.float32)
    r = jnp.maximum(p - q_xV.astype(jnp.float32), 0.0)
    tot = jnp.sum(r, axis=-1, keepdims=True)
    p_tot = jnp.sum(p, axis=-1, keepdims=True)
    ok = tot > 0
    return jnp.where(ok, r / jnp.where(ok, tot, 1.0), p / p_tot)


def expected_acceptance(p_xV: jax.Array, q_xV: jax.Array) -> jax.Array:
    """Per-token acceptance rate α = Σ_x min(p(x), q(x)) over the last axis."""
    return jnp.sum(jnp.minimum(p_xV.astype(jnp.float32), q_xV.astype(jnp.float32)), axis=-1)


def mark_point_mass(draft_logprobs_BxKxV: jax.Array, point_mass_BxK: jax.Array) -> jax.Array:
    """Draft log-probs with the marked positions set to -inf, so :func:`verify` uses the point-mass rule there.

    For batches that mix proposals sampled from a q (e.g. SSD cache hits) with proposals
    that have no distribution (fast backup: n-gram / random), per row or per position.
    """
    return jnp.where(point_mass_BxK[..., None], -jnp.inf, draft_logprobs_BxKxV)


def next_token_logprobs(logp_BxV: jax.Array, q_BxV: jax.Array, rejected_B: jax.Array) -> jax.Array:
    """Log of the distribution the token after the accepted ones is drawn from, per row.

    The residual normalise(max(0, p - q)) where the proposal at that position was rejected,
    else p itself (the bonus token after a fully accepted round, or a row with no proposals).
    ``logp`` is the filtered target log-distribution there, ``q`` the draft's probabilities
    (a one-hot row for a point-mass proposal).
    """
    r = residual_distribution(jnp.exp(logp_BxV), q_BxV)
    return jnp.where(rejected_B[:, None], jnp.log(r), logp_BxV)


def emitted_tokens(draft_tokens_BxK: jax.Array, res: VerifyResult, pad_id: int = -1) -> jax.Array:
    """(B, K+1) tokens emitted by a round: accepted drafts, then ``next_token``, then ``pad_id``.

    Row b emits ``res.n_accepted[b] + 1`` tokens.
    """
    B, K = draft_tokens_BxK.shape
    j = jnp.arange(K + 1)[None, :]
    n = res.n_accepted[:, None]
    drafts = jnp.concatenate([draft_tokens_BxK, jnp.zeros((B, 1), draft_tokens_BxK.dtype)], axis=1)
    out = jnp.where(j < n, drafts, pad_id)
    return jnp.where(j == n, res.next_token[:, None], out).astype(jnp.int32)


def row_keys(key: jax.Array, batch: int) -> jax.Array:
    """A (B,) batch of row keys: ``key`` itself if it already is one, else split(key, B).

    Passing row keys to :func:`verify` makes each row's draws depend only on its own key.
    """
    if is_key_batch(key):
        if key.shape[0] != batch:
            raise ValueError(f"got {key.shape[0]} row keys for a batch of {batch}")
        return key
    return jax.random.split(key, batch)


def _uniforms(key: jax.Array, batch: int, n: int) -> jax.Array:
    """(batch, n) independent float32 uniforms in [tiny, 1): per-row keys if given, else one key.

    A single random-bits call: threefry is slow to compile on CPU, so verify uses one block
    of uniforms per row (acceptance tests first, then the Gumbel noise of the bonus draw).
    """
    lo = jnp.finfo(jnp.float32).tiny
    if is_key_batch(key):
        keys = row_keys(key, batch)
        return jax.vmap(lambda k: jax.random.uniform(k, (n,), jnp.float32, lo, 1.0))(keys)
    return jax.random.uniform(key, (batch, n), jnp.float32, lo, 1.0)


def _row_uniforms(key: jax.Array, batch: int, k: int, v: int) -> jax.Array:
    """(batch, k + v) uniforms for ``verify``: with row keys, the k acceptance uniforms and the v of the
    bonus draw come from two streams of the row's key, so a row's bonus draw does not depend on how many
    columns its round verifies (an n-gram round with no proposal anywhere verifies none): a seeded row's
    tokens do not depend on its batch mates."""
    if not is_key_batch(key):
        return _uniforms(key, batch, k + v)
    keys = row_keys(key, batch)
    acc = _uniforms(fold_in(keys, 0), batch, k)
    bonus = _uniforms(fold_in(keys, 1), batch, v)
    return jnp.concatenate([acc, bonus], axis=1)


# --------------------------------------------------------------------------- verify


def _proposals(draft_tokens_BxK, n_draft_B, V):
    """(n_draft clipped to 0..K, valid (B, K), proposals (B, K)) with the ignored entries (padding past
    n_draft, which may hold anything) set to 0 so gathers stay in range."""
    K = draft_tokens_BxK.shape[1]
    n_draft = jnp.clip(n_draft_B.astype(jnp.int32), 0, K)
    valid_BxK = jnp.arange(K, dtype=jnp.int32)[None, :] < n_draft[:, None]
    return n_draft, valid_BxK, jnp.where(valid_BxK, jnp.clip(draft_tokens_BxK.astype(jnp.int32), 0, V - 1), 0)


def _greedy_accepts(target_logits_BxKp1xV, s_BxK, valid_BxK):
    """(raw argmax per position (B, K+1), accepted (B, K)): s_j is accepted while it equals the argmax."""
    K = s_BxK.shape[1]
    argmax_BxKp1 = jnp.argmax(target_logits_BxKp1xV, axis=-1).astype(jnp.int32)
    ok = valid_BxK & (s_BxK == argmax_BxKp1[:, :K])
    return argmax_BxKp1, jnp.cumprod(ok.astype(jnp.int32), axis=1).astype(bool)


def verify_greedy(
    target_logits_BxKp1xV: jax.Array, draft_tokens_BxK: jax.Array, n_draft_B: jax.Array
) -> VerifyResult:
    """:func:`verify` for a batch whose rows are ALL greedy: the same result as its greedy rows, without
    the sampled rows' work (no uniforms, no log-softmax over the vocabulary, no draft distribution)."""
    V = target_logits_BxKp1xV.shape[-1]
    _, valid_BxK, s_BxK = _proposals(draft_tokens_BxK, n_draft_B, V)
    argmax_BxKp1, acc_BxK = _greedy_accepts(target_logits_BxKp1xV, s_BxK, valid_BxK)
    n_acc = jnp.sum(acc_BxK, axis=1, dtype=jnp.int32)
    return VerifyResult(n_accepted=n_acc, next_token=_take_last(argmax_BxKp1, n_acc), accepted_BxK=acc_BxK)


def _after_accepted(logp_BxKp1xV, draft_logprobs_BxKxV, s_BxK, n_acc, n_draft):
    """The log-distribution of the token after each row's accepted proposals: the target's at position
    n_acc, or the residual ``max(p - q, 0)`` where the proposal there was rejected."""
    B, Kp1, V = logp_BxKp1xV.shape
    K = Kp1 - 1
    logp_n = jnp.take_along_axis(logp_BxKp1xV, n_acc[:, None, None], axis=1)[:, 0]  # (B, V)
    if K == 0:
        return logp_n
    rejected = n_acc < n_draft  # the proposal at n_acc exists and was rejected
    j = jnp.minimum(n_acc, K - 1)
    s_n = _take_last(s_BxK, j)
    point_n = jax.nn.one_hot(s_n, V, dtype=jnp.float32)
    if draft_logprobs_BxKxV is None:
        q_n = point_n
    else:
        lq_n = jnp.take_along_axis(draft_logprobs_BxKxV, j[:, None, None], axis=1)[:, 0]
        q_n = jnp.exp(lq_n.astype(jnp.float32))
        q_n = jnp.where(_take_last(q_n, s_n)[:, None] > 0, q_n, point_n)
    return next_token_logprobs(logp_n, q_n, rejected)


def verify(
    key: jax.Array,
    target_logits_BxKp1xV: jax.Array,
    draft_tokens_BxK: jax.Array,
    n_draft_B: jax.Array,
    rs: RowSampling,
    needs_filter: bool,
    draft_logprobs_BxKxV: jax.Array | None = None,
) -> VerifyResult:
    """Verify a round of K proposals per row against the target (exact; see the module doc).

    Args:
      key: one PRNG key, or a (B,) batch of row keys; typed or raw uint32. Do not reuse a
        key across rounds (fold in the step / split it in the caller).
      target_logits_BxKp1xV: raw target logits; [:, j] predicts the token after the first j
        proposals (j = 0..K).
      draft_tokens_BxK: proposals; entries at j >= n_draft[b] are ignored (any int, e.g. -1).
      n_draft_B: (B,) int, how many proposals of each row are real, 0..K. A row with 0
        proposals just samples one token from p at position 0 (a plain AR step).
      rs: per-row sampling parameters (temperature 0 = greedy), shared with the draft.
      needs_filter: static; True if any row uses top-k / top-p (as for filter_logprobs).
      draft_logprobs_BxKxV: log of the distribution each proposal was actually sampled from,
        i.e. filter_logprobs(draft_logits, rs, needs_filter) with the SAME rs and flag (or
        Saguaro's reweighted distribution if that is what was sampled). None = all
        proposals are point masses. Ignored for greedy rows and at positions >= n_draft.

    Returns:
      VerifyResult; row b emits drafts[b, :n_accepted[b]] followed by next_token[b].
    """
    B, Kp1, V = target_logits_BxKp1xV.shape
    K = Kp1 - 1
    if draft_tokens_BxK.shape != (B, K):
        raise ValueError(f"draft tokens {draft_tokens_BxK.shape} do not match logits {(B, Kp1, V)}")
    if draft_logprobs_BxKxV is not None and draft_logprobs_BxKxV.shape != (B, K, V):
        raise ValueError(f"draft logprobs {draft_logprobs_BxKxV.shape} != {(B, K, V)}")

    u_BxKpV = _row_uniforms(key, B, K, V)
    n_draft, valid_BxK, s_BxK = _proposals(draft_tokens_BxK, n_draft_B, V)
    sampled_B = rs.temperature > 0

    # ---- greedy rows: match the raw argmax
    argmax_BxKp1, g_acc_BxK = _greedy_accepts(target_logits_BxKp1xV, s_BxK, valid_BxK)

    # ---- sampled rows: rejection sampling
    logp_BxKp1xV = filter_logprobs(target_logits_BxKp1xV, rs, needs_filter)
    p_s = jnp.exp(_take_last(logp_BxKp1xV[:, :K], s_BxK))
    if draft_logprobs_BxKxV is None:
        q_s = None
    else:
        q_s = jnp.exp(_take_last(draft_logprobs_BxKxV.astype(jnp.float32), s_BxK))
    a_BxK = _accept_prob_from_values(p_s, q_s)
    u_BxK = u_BxKpV[:, :K]
    s_ok = valid_BxK & (u_BxK < a_BxK)  # u in [tiny, 1): a == 1 always accepts, a == 0 never
    s_acc_BxK = jnp.cumprod(s_ok.astype(jnp.int32), axis=1).astype(bool)

    acc_BxK = jnp.where(sampled_B[:, None], s_acc_BxK, g_acc_BxK)
    n_acc = jnp.sum(acc_BxK, axis=1, dtype=jnp.int32)

    # ---- the token after the accepted ones, at position n_acc
    g_next = _take_last(argmax_BxKp1, n_acc)
    dist_logits = _after_accepted(logp_BxKp1xV, draft_logprobs_BxKxV, s_BxK, n_acc, n_draft)
    # Gumbel-max draw (what jax.random.categorical does), reusing the row's one uniform block.
    gumbel_BxV = -jnp.log(-jnp.log(u_BxKpV[:, K:]))
    s_next = jnp.argmax(dist_logits + gumbel_BxV, axis=-1)
    next_token = jnp.where(sampled_B, s_next.astype(jnp.int32), g_next)

    return VerifyResult(n_accepted=n_acc, next_token=next_token, accepted_BxK=acc_BxK)
