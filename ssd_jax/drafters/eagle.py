"""EAGLE-style draft heads: one decoder layer that reads the target's own features.

A head drafts from what the target has already computed. Its input at position ``j`` is a pair: the
target's features at ``j`` (the outputs of a few of its layers, ``HeadSpec.layers``, fused by one
linear map ``fc``; EAGLE-3 reads a low, a middle and a high layer) and the embedding of token
``j + 1``. One Llama decoder layer with the target's dimensions runs over those pairs with a KV
cache of its own; its output, through the target's frozen final LM head, is the distribution of
token ``j + 2``. Each further draft step feeds the head's own output back in place of the target's
features (the target has not seen the drafted tokens yet)::

    x_j = [rms(emb(t_{j+1})) · n_e , rms(f_j) · n_f] @ w_in       f_j = F_j @ fc (target) or g_{j-1} (own)
    g_j = layer(x_j | the head's cache)     q_j = softmax(lm_head(rms(g_j) · n_o))  ~  t_{j+2}

The head's q is the distribution its token was drawn from, so speculation with it is exact like any
draft's. Its parameters are the layer plus ``fc``, ``w_in`` and three norms; the embedding and LM
head are the target's. A head trained with a trimmed vocabulary (``vocab_ids``: the N most frequent
tokens, as ``--draft-vocab N`` trims a draft model's head) multiplies by those N rows of the target's
LM head only, in training and at decode time; its q is 0 elsewhere (still exact, as for any trimmed
draft). For SmolLM2 at N = 8192 that cuts the LM head, 28M of a draft step's 33M weights, by 6x.

Training (:func:`head_loss`): teacher-forced over the target's own answers, with the target's
features and full next-token distributions computed in the same step (the target is frozen). Step 1
reads the target's features; steps 2..D ("training-time test", as EAGLE-3) read the head's own
outputs, each query seeing the target's pairs up to its position and its own earlier steps there, as
at decode time. The loss is the KL from the target's distribution to the head's at every step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.drafters.base import align_vocab
from ssd_jax.errors import UserError
from ssd_jax.models import llama
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.forms import Forms
from ssd_jax.models.params import layer_specs

#: a head's weights file (its meta rides in the safetensors metadata)
HEAD_WEIGHTS = "head.safetensors"


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """A head's static shape: the target layers it reads (their outputs, in this order)."""

    layers: tuple[int, ...]

    def validate(self, cfg: ModelConfig) -> None:
        if not self.layers or any(not 0 <= i < cfg.num_layers for i in self.layers):
            raise UserError(f"head layers {list(self.layers)} must lie in 0..{cfg.num_layers - 1}")


def default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice: a low, a middle and a high layer (fewer for very shallow targets)."""
    L = num_layers
    return tuple(sorted({min(1, L - 1), L // 2, max(L - 2, 0)}))


def head_config(cfg: ModelConfig) -> ModelConfig:
    """The head's decoder layer: the target's dimensions, one layer, weights in checkpoint layout."""
    return cfg.replace(num_layers=1, forms=Forms(), weight_dtype=None)


def init_head(
    cfg: ModelConfig, spec: HeadSpec, seed: int = 0, scale: float = 0.02, mlp: int | None = None
) -> dict:
    """Random head parameters (numpy draws from an integer seed); norms at 1. ``mlp``: the layer's
    SwiGLU width (default the target's; a narrower one costs less per step and in training, and the
    forward reads the width from the weights)."""
    rng = np.random.default_rng(seed)
    D, n = cfg.hidden_size, len(spec.layers)
    dt = cfg.jnp_dtype

    def normal(*shape, s=scale):
        return jnp.asarray(s * rng.standard_normal(shape, dtype=np.float32), dt)

    lcfg = head_config(cfg) if mlp is None else head_config(cfg).replace(intermediate_size=int(mlp))
    layer = {}
    for name, (shape, _) in sorted(layer_specs(lcfg).items()):
        layer[name] = jnp.ones(shape, dt) if name.endswith("norm") else normal(*shape)
    return {
        "fc": normal(n * D, D, s=1.0 / np.sqrt(n * D)),
        "w_in": normal(2 * D, D, s=1.0 / np.sqrt(2 * D)),
        "norm_e": jnp.ones(D, dt),
        "norm_f": jnp.ones(D, dt),
        "layer": layer,
        "norm_o": jnp.ones(D, dt),
    }


#: head entries that are not trained: the kept ids and, once attached, the LM head rows they select
FROZEN = ("vocab_ids", "lm_rows")


def count_head_params(head: dict) -> int:
    return int(sum(np.prod(x.shape) for k, v in head.items() if k not in FROZEN for x in jax.tree.leaves(v)))


def attach_vocab(head: dict, tparams, cfg: ModelConfig) -> dict:
    """A loaded head ready to draft: with a trimmed vocabulary, its LM head rows cut from the target's
    once (``lm_rows``), not per step."""
    if "vocab_ids" not in head or "lm_rows" in head:
        return head
    ids = jnp.asarray(head["vocab_ids"], jnp.int32)
    return {**head, "vocab_ids": ids, "lm_rows": llama.head_rows(tparams, cfg, ids)}


def head_logits(head, tparams, cfg: ModelConfig, h):
    """The head's logits over the whole vocabulary (-inf outside a trimmed head's kept ids)."""
    if "lm_rows" in head:
        return llama.trimmed_logits({"head": head["lm_rows"], "head_ids": head["vocab_ids"]}, cfg, h)
    return llama.logits(tparams, cfg, h)


def head_inputs(head, tparams, cfg: ModelConfig, tokens_BxT, feats_BxTxF, own: bool):
    """The layer's input ``x`` for pairs (features, next token); ``own``: the features are the head's
    own outputs (D wide), else the target's (n·D wide, fused by ``fc``)."""
    eps = cfg.rms_norm_eps
    emb = llama.embed_tokens(tparams, cfg, tokens_BxT).astype(jnp.float32)
    f = feats_BxTxF.astype(jnp.float32)
    if not own:
        f = f @ head["fc"].astype(jnp.float32)
    x = jnp.concatenate(
        [llama.rms_norm(emb, head["norm_e"], eps), llama.rms_norm(f, head["norm_f"], eps)], -1
    )
    return (x @ head["w_in"].astype(jnp.float32)).astype(cfg.jnp_dtype)


def head_forward(head, tparams, cfg: ModelConfig, tokens_BxT, feats_BxTxF, cache, *, own: bool, **fwd):
    """The head's layer over T pairs at the cache's lengths (or ``fwd``'s slots / positions / mask).
    Returns (normed hidden for the LM head, the layer's output g (fed back), cache with the same
    lengths)."""
    x = head_inputs(head, tparams, cfg, tokens_BxT, feats_BxTxF, own)
    p = {"layers": [head["layer"]], "final_norm": head["norm_o"]}
    h, cache, g = llama.forward(p, head_config(cfg), tokens_BxT, cache, embeds_BxTxD=x, capture=(0,), **fwd)
    return h, g, cache


def init_head_cache(cfg: ModelConfig, batch: int, max_len: int):
    return llama.init_cache(head_config(cfg), batch, max_len)


def head_draft(head, tparams, cache, pend_tok_BxW, pend_feat_BxWxF, pend_n_B, keys, draw, *, cfg, vocab):
    """K draft tokens (``len(keys)``). The head first takes the pending pairs (the target's features
    at the positions verified last round and the tokens after them, ``pend_n`` per row) at its
    cache's lengths, then feeds its own outputs back. ``draw(key, logits, d)`` samples step ``d``.
    Returns (tokens (B, K), q (B, K, V) or None, cache with lengths advanced by ``pend_n``)."""
    start = cache.lengths
    h, g, cache = head_forward(head, tparams, cfg, pend_tok_BxW, pend_feat_BxWxF, cache, own=False)
    last = (pend_n_B - 1)[:, None, None]
    h1, g1 = jnp.take_along_axis(h, last, axis=1)[:, 0], jnp.take_along_axis(g, last, axis=1)[:, 0]
    base = start + pend_n_B
    tok, q = draw(keys[0], align_vocab(head_logits(head, tparams, cfg, h1), vocab), 0)
    toks, qs = [tok], [q]
    for d in range(1, keys.shape[0]):  # K is small and static: unrolled
        h, g1, cache = head_forward(
            head, tparams, cfg, tok[:, None], g1[:, None], cache.with_lengths(base + d - 1), own=True
        )
        g1 = g1[:, 0]
        tok, q = draw(keys[d], align_vocab(head_logits(head, tparams, cfg, h[:, 0]), vocab), d)
        toks.append(tok)
        qs.append(q)
    q = None if qs[0] is None else jnp.stack(qs, axis=1)
    return jnp.stack(toks, axis=1), q, cache.with_lengths(base)


# --- files


def flat_head(head) -> dict[str, np.ndarray]:
    out = {k: np.asarray(v) for k, v in head.items() if k not in ("layer", "lm_rows")}
    out.update({f"layer.{k}": np.asarray(v) for k, v in head["layer"].items()})
    return out


def unflat_head(flat: dict[str, np.ndarray]) -> dict:
    head = {k: jnp.asarray(v) for k, v in flat.items() if not k.startswith("layer.")}
    head["layer"] = {k[6:]: jnp.asarray(v) for k, v in flat.items() if k.startswith("layer.")}
    return head


def save_head(path: Path, head, meta: dict[str, Any], vocab_ids=None, dtype: str | None = None) -> None:
    """``head.safetensors`` (weights, the kept ids of a trimmed vocabulary, the meta as its metadata)
    written to a temporary name and renamed. ``dtype="bfloat16"`` stores the weights at half the bytes
    (a loaded head runs in the target's dtype)."""
    from safetensors.numpy import save_file

    flat = flat_head(head)
    if dtype is not None:
        import ml_dtypes

        dt = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
        flat = {k: v.astype(dt) if np.issubdtype(v.dtype, np.floating) or v.dtype == ml_dtypes.bfloat16 else v
                for k, v in flat.items()}  # fmt: skip
    if vocab_ids is not None:
        flat["vocab_ids"] = np.asarray(vocab_ids, np.int32)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(flat, str(tmp), metadata={"ssd_jax_head": json.dumps(meta)})
    os.replace(tmp, path)


def load_head(path: str | os.PathLike) -> tuple[dict, dict[str, Any]]:
    """(head parameters, meta) from a run directory or a ``head.safetensors`` file."""
    from safetensors import safe_open

    p = Path(path)
    if p.is_dir():
        p = p / HEAD_WEIGHTS
    if not p.is_file():
        raise UserError(f"no EAGLE head at {path} (expected {HEAD_WEIGHTS})")
    with safe_open(str(p), "np") as f:
        meta = json.loads((f.metadata() or {}).get("ssd_jax_head", "{}"))
        flat = {k: f.get_tensor(k) for k in f.keys()}
    if "layers" not in meta:
        raise UserError(f"{p} is not an ssd_jax EAGLE head (no head metadata)")
    return unflat_head(flat), meta


# --- training


def target_features(tparams, cfg: ModelConfig, tokens_BxT, layers: tuple[int, ...]):
    """The target over whole sequences: (its features at ``layers`` (B, T, n·D), its log-probabilities
    of the next token (B, T, V)), no gradient."""
    B, T = tokens_BxT.shape
    h, _, f = llama.forward(tparams, cfg, tokens_BxT, llama.init_cache(cfg, B, T), capture=layers)
    lp = jax.nn.log_softmax(llama.logits(tparams, cfg, h), axis=-1)
    return jax.lax.stop_gradient(f), jax.lax.stop_gradient(lp)


def unrolled_logits(head, tparams, cfg: ModelConfig, tokens_BxT, feats_BxTxF, depth: int, ids=None):
    """The head's log-probabilities at every position for draft steps 1..``depth`` (a list of
    (B, T - 1 - d, V), or N wide over the kept ``ids`` of a trimmed vocabulary; step d + 1 at
    position j predicting token ``j + d + 2``): step 1 over the
    target's features, later steps over the head's own outputs, each query seeing the target's pairs
    up to its position and its own earlier steps there (the decode-time view)."""
    B, T = tokens_BxT.shape
    n = T - 1  # pairs (F_j, t_{j+1}) for j = 0..T-2
    S = depth * n
    cache = llama.init_cache(head_config(cfg), B, S)
    j = jnp.arange(n)
    slot = jnp.arange(S)
    outs = []
    g = feats_BxTxF[:, :n]
    for d in range(depth):
        toks = tokens_BxT[:, 1 + d : 1 + d + n]  # pair (feature at j + d, token j + d + 1)
        m = toks.shape[1]
        jj = j[:m]
        # query (step d, position j) sees the target's pairs <= j and its own steps 1..d at j
        mask = (slot[None, :] < n) & (slot[None, :] <= jj[:, None])
        for e in range(1, d + 1):
            mask = mask | (slot[None, :] == e * n + jj[:, None])
        h, g, cache = head_forward(
            head, tparams, cfg, toks, g[:, :m], cache, own=d > 0,
            slots_BxT=jnp.broadcast_to(d * n + jj, (B, m)),
            positions_BxT=jnp.broadcast_to(jj + d, (B, m)),  # pair j + d's position
            mask_BxTxS=jnp.broadcast_to(mask, (B, m, S)),
        )  # fmt: skip
        z = llama.logits(tparams, cfg, h) if ids is None else llama.kept_logits(tparams, cfg, h, ids)
        outs.append(jax.nn.log_softmax(z, axis=-1))
    return outs


def _proposal(q_lp, ids):
    """The head's greedy proposal (a token id) from its log-probabilities (N wide over ``ids``)."""
    a = jnp.argmax(q_lp, -1)
    return a if ids is None else ids[a]


def _step_losses(outs, p_kept, top, mask_BxT, ids):
    """(mean KL over draft steps, stats) for the head's log-probabilities ``outs`` (per step, N wide
    over ``ids`` or V wide) against the target's log-probabilities ``p_kept`` (B, T, same width) and its
    greedy tokens ``top`` (B, T) at every position."""
    total, stats = 0.0, {}
    for d, q_lp in enumerate(outs):
        m = q_lp.shape[1]
        p = p_kept[:, 1 + d : 1 + d + m]  # the target at position j + d + 1 predicts token j + d + 2
        w = mask_BxT[:, 1 + d : 1 + d + m]
        den = jnp.maximum(w.sum(), 1.0)
        kl = (jnp.exp(p) * (p - q_lp)).sum(-1)
        agree = (top[:, 1 + d : 1 + d + m] == _proposal(q_lp, ids)).astype(jnp.float32)
        overlap = jnp.minimum(jnp.exp(p), jnp.exp(q_lp)).sum(-1)
        stats[f"kl_{d + 1}"] = (kl * w).sum() / den
        stats[f"agree_{d + 1}"] = (agree * w).sum() / den
        stats[f"overlap_{d + 1}"] = (overlap * w).sum() / den
        total = total + stats[f"kl_{d + 1}"]
    return total / len(outs), stats


def head_loss(head, tparams, tokens_BxT, mask_BxT, ids=None, *, cfg: ModelConfig, spec: HeadSpec, depth: int):
    """(mean KL over draft steps and masked positions, stats). ``mask[j]``: the weight of the draft
    steps that predict token ``j + 1`` (1 where it is one of the target's generated tokens). ``ids``: a
    trimmed vocabulary's kept ids; the KL is then over them (the target's mass elsewhere is a constant
    the head cannot reach). Stats: per step the KL, the share of argmax agreement (greedy acceptance
    of that step given the earlier ones) and ``sum min(p, q)`` (acceptance at temperature 1)."""
    feats, p_lp = target_features(tparams, cfg, tokens_BxT, spec.layers)
    outs = unrolled_logits(head, tparams, cfg, tokens_BxT, feats, depth, ids)
    p = p_lp if ids is None else jnp.take(p_lp, ids, axis=-1)
    return _step_losses(outs, p, jnp.argmax(p_lp, -1), mask_BxT, ids)


def cached_targets(tparams, cfg: ModelConfig, tokens_BxT, layers: tuple[int, ...]):
    """What a cached-feature run stores per position (:mod:`ssd_jax.training.eagle_cache`): the
    target's features at ``layers``, its normed final hidden state, the log-normaliser of its
    next-token logits and its greedy token. The kept log-probabilities are ``kept_logits(hidden) -
    lse``, recomputed in each step at N/V of the full head's cost."""
    B, T = tokens_BxT.shape
    h, _, f = llama.forward(tparams, cfg, tokens_BxT, llama.init_cache(cfg, B, T), capture=layers)
    z = llama.logits(tparams, cfg, h)
    return f, h, jax.nn.logsumexp(z, axis=-1), jnp.argmax(z, -1).astype(jnp.int32)


def head_loss_cached(
    head, tparams, tokens_BxT, feats_BxTxF, hidden_BxTxD, lse_BxT, top_BxT, mask_BxT, ids=None, *,
    cfg: ModelConfig, depth: int,
):  # fmt: skip
    """:func:`head_loss` from stored target outputs (:func:`cached_targets`): the target does not run."""
    outs = unrolled_logits(head, tparams, cfg, tokens_BxT, feats_BxTxF.astype(cfg.jnp_dtype), depth, ids)
    h = hidden_BxTxD.astype(cfg.jnp_dtype)
    z = llama.logits(tparams, cfg, h) if ids is None else llama.kept_logits(tparams, cfg, h, ids)
    return _step_losses(outs, z - lse_BxT[..., None], top_BxT, mask_BxT, ids)


@functools.lru_cache(maxsize=8)
def make_head_step(cfg: ModelConfig, spec: HeadSpec, depth: int, optimizer, cached: bool = False):
    """One optax step: (head, opt_state, tparams, *batch) -> (head, opt_state, loss, stats); the batch is
    (tokens, mask, kept ids or None), or with ``cached`` (tokens, features, hidden, lse, top, mask, ids)."""
    if cached:
        loss_fn = functools.partial(head_loss_cached, cfg=cfg, depth=depth)
    else:
        loss_fn = functools.partial(head_loss, cfg=cfg, spec=spec, depth=depth)

    def step(head, opt_state, tparams, *batch):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(head, tparams, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, head)
        import optax

        return optax.apply_updates(head, updates), opt_state, loss, stats

    return jax.jit(step, donate_argnums=(0, 1))


def greedy_acceptance(
    head, tparams, tokens_BxT, mask_BxT, ids=None, *, cfg: ModelConfig, spec: HeadSpec, k: int
):
    """Teacher-forced greedy SD acceptance on the target's own T = 0 answers: at every scored position,
    how many of the head's K greedy proposals match the target's argmax continuation before the first
    miss. Returns (accepted counts (B, T'), mask (B, T')) for positions with K scored tokens after."""
    feats, p_lp = target_features(tparams, cfg, tokens_BxT, spec.layers)
    outs = unrolled_logits(head, tparams, cfg, tokens_BxT, feats, k, ids)
    m = outs[-1].shape[1]
    ok, alive = jnp.zeros(tokens_BxT.shape[0:1] + (m,), jnp.int32), jnp.ones((tokens_BxT.shape[0], m), bool)
    w = jnp.ones((tokens_BxT.shape[0], m), bool)
    for d, q_lp in enumerate(outs):
        hit = _proposal(q_lp[:, :m], ids) == jnp.argmax(p_lp[:, 1 + d : 1 + d + m], -1)
        alive = alive & hit
        ok = ok + alive
        w = w & (mask_BxT[:, 1 + d : 1 + d + m] > 0)
    return ok, w


# --- a head named as a draft (``--draft eagle:PATH``, a directory or a shipped name)

PREFIX = "eagle:"


def eagle_source(draft) -> str | None:
    """Where an EAGLE head given as a draft lives (a ``head.safetensors`` file or a directory holding
    one), or None if ``draft`` is not a head. A head is ``eagle:PATH`` (PATH a file, a directory or a
    shipped name), or a directory or shipped name (``checkpoints/<name>/``, as draft models are found)
    that holds a ``head.safetensors``."""
    from ssd_jax.loading.draft import resolve_head

    if not isinstance(draft, str):
        return None
    ref, forced = (draft[len(PREFIX) :], True) if draft.startswith(PREFIX) else (draft, False)
    p = Path(ref).expanduser()
    if (forced and p.is_file()) or (p / HEAD_WEIGHTS).is_file():
        return str(p)
    if ref and "/" not in ref and not p.exists() and (d := resolve_head(ref)) is not None:
        return str(d)
    return ref if forced else None  # eagle:PATH that is not there: load_head says so


def is_eagle(draft) -> bool:
    return eagle_source(draft) is not None


def load_eagle(model, draft: str):
    """(head parameters, meta) of a head (:func:`eagle_source`), checked against the target."""
    head, meta = load_head(eagle_source(draft))
    dt = model.cfg.jnp_dtype  # a head stored in bfloat16 runs in the target's dtype
    head = jax.tree.map(
        lambda x: x.astype(dt) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, head
    )
    spec = HeadSpec(tuple(int(i) for i in meta["layers"]))
    spec.validate(model.cfg)
    if meta.get("target_sha256") not in (None, model.weights_sha256):
        raise UserError(f"the head {draft} was trained for another target ({meta.get('target')})")
    D = model.cfg.hidden_size
    if head["fc"].shape != (len(spec.layers) * D, D):
        raise UserError(
            f"the head {draft} does not fit this target (width {head['fc'].shape[1]}, target {D})"
        )
    return head, meta
