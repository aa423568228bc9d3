"""Independent references for the exactness tests: a numpy float64 forward pass (no KV cache,
no JAX, no speculation code), the sampling filter re-derived in numpy, and the goodness-of-fit
statistics that pool every emitted token.

Goodness of fit (the randomised probability integral transform, PIT). For an emitted token x
with exact conditional distribution p (given that row's actual prefix), sort the vocabulary
by descending p (ties by id) and set u = P(tokens before x) + V * p(x), with V ~ U(0, 1)
drawn by the test. If every token is drawn from its conditional, the u's of a row are i.i.d.
U(0, 1) (the Rosenblatt transform), whatever the prefixes were, so the u's of all tokens of
all rows can be pooled and tested for uniformity (chi-square over equal-width bins, and
Kolmogorov-Smirnov).

Because the order is by probability, u is small when the token was likely: a sampler that
favours likely tokens (e.g. "accept iff argmax") piles u near 0, one that favours unlikely
ones (a wrong residual) piles it near 1. A bias that only permutes mass among tokens of the
same rank is invisible to this test; the strata below and the negative controls show which
bugs it catches.

Strata. The tokens are also tested per *offset within their round* (0 = the first token a
round emits, ..., K = the bonus token after a fully accepted round). The offset of a token
is fixed before the token is drawn (it depends only on earlier accept decisions), so within
each stratum the u's are still i.i.d. uniform. A stratum isolates e.g. the bonus tokens,
which are a few percent of all tokens but carry all of a bonus-token bug.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats as sps

from ssd_jax.loading import LoadedModel
from ssd_jax.models.forms import CANONICAL
from ssd_jax.models.params import flatten, to_layout, unflatten

# --------------------------------------------------------------------------- numpy model


def _np(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _np(w)


def _rope(x_BxNxTxh, inv):
    T = x_BxNxTxh.shape[2]
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    h = x_BxNxTxh.shape[-1] // 2
    x1, x2 = x_BxNxTxh[..., :h], x_BxNxTxh[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


_WEIGHTS: dict = {}  # id(params) -> (params, cfg, the canonical float64 tree): one conversion per model


def _canonical(model: LoadedModel):
    cfg = model.cfg.replace(forms=CANONICAL)  # the reference reads weights in the checkpoint layout
    hit = _WEIGHTS.get(id(model.params))
    if hit is None or hit[0] is not model.params or hit[1] != cfg:
        flat = {n: _np(to_layout(model.cfg, cfg, n, np.asarray(w))) for n, w in flatten(model.params).items()}
        hit = _WEIGHTS[id(model.params)] = (model.params, cfg, unflatten(cfg, flat))
        while len(_WEIGHTS) > 8:  # (a cached model's params stay alive: a few models only)
            del _WEIGHTS[next(iter(_WEIGHTS))]
    return hit[1], hit[2]


def np_logits(model: LoadedModel, ids) -> np.ndarray:
    """(T, V) float64 logits of one sequence: position t predicts token t + 1. Full context, causal."""
    return np_logits_rows(model, [ids])[0]


def np_logits_rows(model: LoadedModel, rows) -> np.ndarray:
    """(N, T, V) float64 logits of N sequences of one length T, each on its own (as :func:`np_logits`)."""
    cfg, P = _canonical(model)
    if cfg.rope_scaling is not None:
        raise NotImplementedError("the reference covers the tiny test models (no RoPE scaling)")
    ids = np.asarray(rows, np.int64)
    T = ids.shape[1]
    H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    x = P["embed"][ids]
    causal = np.tril(np.ones((T, T), bool))
    B = ids.shape[0]

    def heads(h, w_NxhxD):  # (B, T, D) -> (B, N, T, h)
        n, hh, d = w_NxhxD.shape
        return (h @ w_NxhxD.reshape(n * hh, d).T).reshape(B, T, n, hh).transpose(0, 2, 1, 3)

    for L in P["layers"]:
        h = _rms(x, L["attn_norm"], cfg.rms_norm_eps)
        q, k, v = heads(h, L["wq"]), heads(h, L["wk"]), heads(h, L["wv"])
        if cfg.qkv_bias:
            q, k, v = (y + b[None, :, None, :] for y, b in ((q, L["bq"]), (k, L["bk"]), (v, L["bv"])))
        q, k = _rope(q, inv), _rope(k, inv)
        k, v = np.repeat(k, H // KVH, axis=1), np.repeat(v, H // KVH, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
        s = np.where(causal[None, None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, H * hd)
        x = x + o @ L["wo"].reshape(L["wo"].shape[0], H * hd).T
        h = _rms(x, L["mlp_norm"], cfg.rms_norm_eps)
        g, u = h @ L["w_gate"].T, h @ L["w_up"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ L["w_down"].T
    x = _rms(x, P["final_norm"], cfg.rms_norm_eps)
    w = P["embed"] if cfg.tie_embeddings else P["lm_head"]
    return x @ w.T


def filtered_probs(
    logits_NxV: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    """The distribution sampled from (HF / vLLM conventions: top-k, then top-p on the renormalised rest;
    a token is kept while the mass strictly before it is < top_p)."""
    x = np.asarray(logits_NxV, np.float64) / temperature
    order = np.argsort(-x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, -1)
    keep = np.ones_like(xs, bool)
    if top_k > 0:
        keep[:, top_k:] = False
    ps = np.where(keep, np.exp(xs - xs.max(-1, keepdims=True)), 0.0)
    ps /= ps.sum(-1, keepdims=True)
    if top_p < 1.0:
        keep &= (np.cumsum(ps, -1) - ps) < top_p
        ps = np.where(keep, ps, 0.0)
        ps /= ps.sum(-1, keepdims=True)
    out = np.zeros_like(ps)
    np.put_along_axis(out, order, ps, -1)
    return out


def greedy_continuation(model: LoadedModel, prefix, n: int) -> list[int]:
    """n greedy tokens after ``prefix`` (argmax, ties to the lowest id), one full forward per token."""
    seq = list(prefix)
    for _ in range(n):
        seq.append(int(np.argmax(np_logits(model, seq)[-1])))
    return seq[len(prefix) :]


# --------------------------------------------------------------------------- test models


def noisy_copy(model: LoadedModel, sigma: float, seed: int, name: str | None = None) -> LoadedModel:
    """The target's weights plus N(0, sigma) noise on every matrix: a draft that partly agrees."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def perturb(path, w):
        if w.ndim < 2:
            return w
        return jnp.asarray(np.asarray(w) + sigma * rng.standard_normal(w.shape).astype(np.float32), w.dtype)

    params = jax.tree_util.tree_map_with_path(perturb, model.params)
    return dataclasses.replace(
        model,
        name=name or f"{model.name}+noise{sigma}",
        params=params,
        weights_sha256=f"{model.weights_sha256}+noise{sigma}/{seed}",
    )


# --------------------------------------------------------------------------- goodness of fit


@dataclasses.dataclass
class Emissions:
    """Every emitted token of a run with its exact conditional and its offset within its round."""

    probs: np.ndarray  # (N, V) exact conditional of each emitted token
    tokens: np.ndarray  # (N,)
    offsets: np.ndarray  # (N,) 0..K: position within the round that emitted it (-1 = the prefill token)

    def biased(self, delta: float, kind: str, rng) -> Emissions:
        """The same conditionals with tokens redrawn from a distribution at total-variation distance
        ``delta`` from each (for power checks): ``kind`` "to_top" moves delta of the mass onto the most
        likely token, "to_tail" moves delta off the most likely token onto the others (in proportion)."""
        p = self.probs
        top = np.argmax(p, -1)
        onehot = np.zeros_like(p)
        onehot[np.arange(len(p)), top] = 1.0
        if kind == "to_top":
            d = np.minimum(delta, 1 - p[np.arange(len(p)), top])[:, None]
            rest = p * (1 - onehot)
            q = p + d * onehot - d * rest / np.maximum(rest.sum(-1, keepdims=True), 1e-300)
        elif kind == "to_tail":
            d = np.minimum(delta, p[np.arange(len(p)), top] * 0.999)[:, None]
            rest = p * (1 - onehot)
            q = p - d * onehot + d * rest / np.maximum(rest.sum(-1, keepdims=True), 1e-300)
        else:
            raise ValueError(kind)
        q = np.clip(q, 0, None)
        q /= q.sum(-1, keepdims=True)
        c = q.cumsum(-1)
        toks = np.minimum((c < rng.random((len(q), 1))).sum(-1), q.shape[1] - 1)
        return Emissions(p, toks, self.offsets)


def collect(target: LoadedModel, prompts, outputs, k: int, sampling) -> Emissions:
    """Exact conditionals of every emitted token (numpy reference, full context) and its round offset.

    ``outputs``: the engine's outputs (one per row, rows = prompts x n, in order). The offset of
    each token comes from the row's ``accepted_per_round`` (absent for AR: all offsets 0).
    """
    n = len(outputs) // len(prompts)
    seqs = [list(prompts[i // n]) + list(o["token_ids"])[:-1] for i, o in enumerate(outputs)]
    by_len: dict[int, list[int]] = {}  # rows of one length run as one batch of the reference
    for i, seq in enumerate(seqs):
        by_len.setdefault(len(seq), []).append(i)
    logits = [None] * len(outputs)
    for idx in by_len.values():
        for i, lg in zip(idx, np_logits_rows(target, [seqs[i] for i in idx])):
            logits[i] = lg
    probs, toks, offs = [], [], []
    for i, o in enumerate(outputs):
        prompt = list(prompts[i // n])
        gen = list(o["token_ids"])
        lg = logits[i][len(prompt) - 1 :]
        probs.append(filtered_probs(lg, sampling.temperature, sampling.top_k, sampling.top_p))
        toks.append(gen)
        off = [-1]  # the first token comes from the prefill
        for a in o.get("metrics", {}).get("accepted_per_round", []):
            off.extend(range(a + 1))
        off = (off + [0] * len(gen))[: len(gen)]
        offs.append(off)
    return Emissions(np.concatenate(probs), np.concatenate(toks), np.concatenate(offs))


def pit(em: Emissions, seed: int = 0) -> np.ndarray:
    """Randomised PIT values u (see the module doc), in [0, 1)."""
    p = em.probs
    N = len(p)
    order = np.argsort(-p, axis=-1, kind="stable")
    ps = np.take_along_axis(p, order, -1)
    rank = np.argmax(order == em.tokens[:, None], axis=-1)
    before = np.where(np.arange(p.shape[1])[None] < rank[:, None], ps, 0.0).sum(-1)
    px = p[np.arange(N), em.tokens]
    u = before + np.random.default_rng(seed).random(N) * px
    return np.clip(u, 0.0, np.nextafter(1.0, 0.0))


def uniformity_pvalues(u: np.ndarray) -> tuple[float, float]:
    """Two tests of u against U(0, 1): Pearson chi-square over 10 equal-width bins (expected count
    >= 20 per bin; omnibus) and Kolmogorov-Smirnov (most powerful here against mass moved between
    likely and unlikely tokens: 0.55-0.6 at TV 0.03 against 0.2 for the chi-square, by simulation)."""
    n = len(u)
    if n < 40:
        return 1.0, 1.0
    bins = int(min(10, n // 20))
    obs = np.bincount(np.minimum((u * bins).astype(int), bins - 1), minlength=bins)
    exp = n / bins
    chi = float(sps.chi2.sf(((obs - exp) ** 2 / exp).sum(), bins - 1))
    return chi, float(sps.kstest(u, "uniform").pvalue)


@dataclasses.dataclass
class FitReport:
    n: int
    pooled: tuple[float, float]  # (chi-square p, KS p) over all tokens
    strata: dict  # offset -> (count, (chi-square p, KS p))
    outside_support: int
    alpha: float

    @property
    def pvalues(self) -> list[float]:
        return list(self.pooled) + [p for _, ps in self.strata.values() for p in ps]

    @property
    def rejected(self) -> bool:
        """Any token outside the support, or any test below alpha / (number of tests) (Bonferroni)."""
        ps = self.pvalues
        return self.outside_support > 0 or min(ps) < self.alpha / len(ps)

    def __str__(self) -> str:
        def f(ps):
            return f"chi2 p={ps[0]:.2g} KS p={ps[1]:.2g}"

        st = "; ".join(f"{o}: n={c} {f(ps)}" for o, (c, ps) in sorted(self.strata.items()))
        return (
            f"n={self.n} pooled {f(self.pooled)}; strata {st}; outside support {self.outside_support}; "
            f"alpha {self.alpha:g} over {len(self.pvalues)} tests"
        )


#: family-wise significance level of each goodness-of-fit test (Bonferroni over its strata and both tests)
ALPHA = 1e-4


def goodness_of_fit(em: Emissions, alpha: float = ALPHA, seed: int = 0) -> FitReport:
    """Pooled and per-offset PIT uniformity tests of a run's emissions."""
    u = pit(em, seed)
    outside = int((em.probs[np.arange(len(em.tokens)), em.tokens] <= 0).sum())
    strata = {}
    for off in np.unique(em.offsets):
        if off < 0:
            continue
        sel = em.offsets == off
        if sel.sum() >= 100:
            strata[int(off)] = (int(sel.sum()), uniformity_pvalues(u[sel]))
    return FitReport(len(u), uniformity_pvalues(u), strata, outside, alpha)
