"""Speculative speculative decoding (SSD, the Saguaro algorithm), exact at every temperature.

SD leaves the draft idle while the target verifies. In SSD the draft runs on its own
devices and, while the target verifies round T, predicts the likely verification outcomes
of round T and pre-drafts round T+1 for each of them into a speculation cache. When the
outcome arrives, a cache hit hands over the next speculation at once (REFERENCE.md §2).

State between rounds, per row (as in SD): both KV caches hold the committed context
(length L), ``cur`` is the last emitted token (in no cache yet), and ``spec`` is the
speculation to verify next: K tokens, how many are real, and - when sampling - the K draft
distributions q they were drawn from (or point masses, for fast fallback proposals).

One round, all compiled static-shape programs:

* target mesh - ``verify``: score ``[cur, s_1..s_K]`` (K+1 positions, one pass), then
  ``sample``: exact rejection sampling (:mod:`ssd_jax.verify`) gives the outcome
  (k accepted, bonus token t*) per row.
* draft mesh, dispatched right after the verify without waiting for it - ``build``:
  1. re-run the draft over ``[cur, s_1..s_K]`` (this also writes those K+1 slots of the
     draft cache, which every outcome's committed prefix needs);
  2. at each position k take the top-F_k draft tokens, EXCLUDING s_{k+1} when k < n_draft
     (a rejected proposal has zero residual mass, it cannot be the bonus there) - each
     candidate (k, t) is a branch; the per-row fan-out F is chosen on the host
     (:mod:`ssd_jax.fanout`, geometric per Theorem 12 with a and r estimated online);
  3. decode all batch x B branches for K steps in ONE call (``lax.scan``): branch (k, t)
     attends to the prefix, the first k+1 re-run tokens and its own earlier tokens (a tree
     mask), at RoPE positions L+k+1+d, with its keys/values in a tree region of the draft
     cache past the main slots; Saguaro sampling (below) draws each branch token and its
     distribution is stored with it.
* draft mesh - ``advance``: only the outcome arrays (k, t*, new length per row) cross from
  target to draft. The lookup matches (k, t*) against the branch keys ON DEVICE and
  returns the cached speculation and a hit flag per row. Rows that missed get a fallback
  inside the same call: the neural backup (the draft re-drafts K tokens just in time; a
  ``lax.cond`` skips it when every live row hit) or random tokens (point masses). The
  n-gram fast backup needs the token history, so it runs on the host after the round's
  one blocking read (the EOS / stop checks) and is merged in.

Exactness. A cached speculation carries the distributions its tokens were sampled from, so
hits are verified by the ratio rule with the right q; neural fallbacks likewise; fast
fallbacks are point masses (accept with p(x), else resample from p without x). Every rule
is exact for any proposal, so the output follows the target distribution on hits and on
misses, at every temperature (the reference engine is not exact on misses at T > 0).

Saguaro sampling (Definition 14): the draft samples from σ_{F,C}, its filtered distribution
with the probability of its top-F tokens multiplied by C and renormalised (F = the fan-out
of that position). Lowering C pushes the residual max(0, p − σ) onto the cached tokens, so
bonus tokens land in the cache more often, at some cost in acceptance. σ is what the
verifier receives as q, so exactness is untouched. C = 1 is plain sampling.

Backup choice. ``auto`` picks the neural backup below a critical batch size b* and the
n-gram (fast) one above it; b* comes from Corollary 16 (:func:`ssd_jax.fanout.critical_batch_size`)
with the hit rate and the tokens per round after hits and misses observed so far in this run,
and the build, verify and fallback times of a roofline estimate made once before the first
round (:func:`backup_cost_estimate`, reported as ``metrics["backup_model"]``). No clock is
read for the decision, so a seeded run gives the same tokens every time.

Placement. The target lives on a target mesh (tensor parallel), the draft on a disjoint
draft mesh (parameters replicated; the branch axis sharded over its devices, so more draft
devices buy a larger fan-out budget at the same latency). Without ``target_devices`` /
``draft_devices`` both models share one device and run the same algorithm sequentially.

Timing. Each dispatched program is recorded on its device lane (:mod:`ssd_jax.trace`); an
event ends when its outputs are ready and starts when it was dispatched or when its lane
finished the previous event, whichever is later. ``--trace FILE`` writes them as a Chrome
/ Perfetto trace; the overlap of ``build`` with ``verify`` is reported as
``overlap_fraction``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ssd_jax import fanout as fo
from ssd_jax import runtime
from ssd_jax.drafters import align_vocab, check_same_tokenizer, draft_prefill, ngram_lookup
from ssd_jax.engine import GenerationResult, RowState, _cache_for, eos_ids, plan_batch, speed_metrics
from ssd_jax.errors import UserError
from ssd_jax.models import llama
from ssd_jax.sampling import RowSampling, filter_logprobs
from ssd_jax.sd import push_round, sd_steps
from ssd_jax.stats import AcceptanceStats
from ssd_jax.trace import Timeline, lane_for
from ssd_jax.verify import mark_point_mass


# --------------------------------------------------------------------------- Saguaro sampling


def saguaro_logprobs(logprobs: jax.Array, fan: jax.Array, c: float, f_max: int) -> jax.Array:
    """σ_{F,C}: multiply the probability of each row's top-F tokens by C and renormalise.

    Args:
      logprobs: (..., V) filtered draft log-probabilities (-inf outside the support).
      fan: int array broadcastable to ``logprobs.shape[:-1]``, F per row / position (0 = off).
      c: the Saguaro constant in [0, 1] (static). 1 returns ``logprobs`` unchanged.
      f_max: static upper bound on F.
    A row whose whole support lies in its top-F set with C = 0 keeps its distribution (σ
    would be empty there).
    """
    if c >= 1.0 or f_max <= 0:
        return logprobs
    vals, idx = jax.lax.top_k(logprobs, f_max)
    in_set = jnp.arange(f_max) < jnp.asarray(fan)[..., None]
    log_c = math.log(c) if c > 0 else -jnp.inf
    new_vals = jnp.where(in_set & jnp.isfinite(vals), vals + log_c, vals)
    out = jnp.put_along_axis(logprobs, idx, new_vals, axis=-1, inplace=False)
    tot = jax.nn.logsumexp(out, axis=-1, keepdims=True)
    ok = jnp.isfinite(tot)
    return jnp.where(ok, out - jnp.where(ok, tot, 0.0), logprobs)


def draft_sample(key, logits, rs: RowSampling, fan, *, needs_filter, greedy, c, f_max):
    """Sample draft tokens from σ_{F,C} of the filtered logits; returns (tokens, logprobs | None).

    ``logits`` is (B, ..., V); greedy runs take the raw argmax and keep no distribution.
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    lp = saguaro_logprobs(filter_logprobs(logits, rs, needs_filter), fan, c, f_max)
    return jax.random.categorical(key, lp, axis=-1).astype(jnp.int32), lp


# --------------------------------------------------------------------------- device programs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Spec:
    """The speculation verified next, per row."""

    tokens: jax.Array  # (B, K) int32
    n_draft: jax.Array  # (B,) int32
    q: jax.Array | None  # (B, K, V) float32 log-probs (-inf rows = point masses), None when greedy
    hit: jax.Array  # (B,) bool, came from the speculation cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    """The speculation cache of one round: B branches per row keyed by (k, t)."""

    k: jax.Array  # (B, M) int32 accepted-length key, -1 for unused slots
    t: jax.Array  # (B, M) int32 bonus-token key
    tokens: jax.Array  # (B, M, K) int32
    q: jax.Array | None  # (B, M, K, V) float32, None when greedy


@dataclasses.dataclass(frozen=True)
class Opts:
    """Static options of the SSD programs (hashable: part of the compile cache key)."""

    k: int
    budget: int
    vocab: int  # the target's vocabulary size (draft logits are aligned to it)
    rand_vocab: int  # ids the random backup draws from
    needs_filter: bool
    greedy: bool
    c: float
    tree_base: int  # first slot of the tree region in the draft cache
    mesh: jax.sharding.Mesh | None = None  # the draft mesh; with > 1 device the branch axis is sharded over it


def branch_sharding(mesh, ndim: int) -> NamedSharding:
    """(B, M, ...) arrays: the branch axis M split over the draft mesh."""
    return NamedSharding(mesh, PartitionSpec(None, "tp", *([None] * (ndim - 2))))


def _constrain(x, opts: Opts):
    if opts.mesh is None or x is None:
        return x
    return jax.lax.with_sharding_constraint(x, branch_sharding(opts.mesh, x.ndim))


def _replicate(tree, opts: Opts):
    if opts.mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(opts.mesh, PartitionSpec()))


def draft_chain(params, cache, cur_B, key, rs, fan_BxK, *, cfg, opts: Opts):
    """K draft tokens after ``cur`` (cache lengths = committed length; cur not in the cache).

    Returns (tokens (B, K), q (B, K, V) | None, cache with the same lengths).
    """
    start = cache.lengths

    def body(carry, xs):
        cache, tok = carry
        d, key_d = xs
        h, cache = llama.forward(params, cfg, tok[:, None], cache.with_lengths(start + d))
        lg = align_vocab(llama.logits(params, cfg, h[:, 0]), opts.vocab)
        nxt, lp = draft_sample(key_d, lg, rs, fan_BxK[:, d], needs_filter=opts.needs_filter, greedy=opts.greedy,
                               c=opts.c, f_max=opts.budget)
        return (cache, nxt), (nxt, lp)

    (cache, _), (toks, qs) = jax.lax.scan(body, (cache, cur_B), (jnp.arange(opts.k), jax.random.split(key, opts.k)))
    q = None if qs is None else jnp.moveaxis(qs, 0, 1)
    return toks.T, q, cache.with_lengths(start)


def build_tree(params, cache, cur_B, spec_tokens, spec_n, kb_BxM, rb_BxM, fan_BxK, key, rs, *, cfg, opts: Opts):
    """Predict the outcomes of the speculation being verified and pre-draft each (see module doc)."""
    K, M = opts.k, opts.budget
    B = cur_B.shape[0]
    start = cache.lengths
    # 1. re-run [cur, s_1..s_K]: K+1 next-token distributions, and those slots written
    h, cache = llama.forward(params, cfg, jnp.concatenate([cur_B[:, None], spec_tokens], axis=1), cache)
    lg = align_vocab(llama.logits(params, cfg, h), opts.vocab)  # (B, K+1, V)
    # 2. candidates: top-M per position, excluding s_{k+1} where it was a real proposal
    nxt = jnp.concatenate([spec_tokens, jnp.zeros((B, 1), spec_tokens.dtype)], axis=1)
    excl = jnp.arange(K + 1)[None, :] < spec_n[:, None]
    cur_val = jnp.take_along_axis(lg, nxt[..., None], axis=-1)
    lg = jnp.put_along_axis(lg, nxt[..., None], jnp.where(excl[..., None], -jnp.inf, cur_val), axis=-1, inplace=False)
    _, cand = jax.lax.top_k(lg, M)  # (B, K+1, M)
    valid = kb_BxM >= 0
    kb = jnp.clip(kb_BxM, 0, K)
    flat = kb * M + jnp.clip(rb_BxM, 0, M - 1)
    t0 = jnp.take_along_axis(cand.reshape(B, (K + 1) * M), flat, axis=1).astype(jnp.int32)
    t0 = _constrain(t0, opts)
    # 3. decode every branch K steps under the tree mask
    S = cache.max_len
    slot = jnp.arange(S)
    prefix = slot[None, None, :] <= (start[:, None] + kb)[:, :, None]  # context + cur + s_1..s_k
    base = opts.tree_base + jnp.arange(M) * K  # (M,) first tree slot of each branch
    pos0 = start[:, None] + kb + 1

    def body(carry, xs):
        cache, tok = carry
        d, key_d = xs
        own = (slot[None, :] >= base[:, None]) & (slot[None, :] <= base[:, None] + d)  # (M, S)
        h, cache = llama.forward(
            params, cfg, tok, cache,
            positions_BxT=pos0 + d,
            slots_BxT=jnp.broadcast_to(base + d, (B, M)),
            mask_BxTxS=prefix | own[None],
        )
        lg = align_vocab(llama.logits(params, cfg, h), opts.vocab)  # (B, M, V)
        fan = jnp.broadcast_to(fan_BxK[:, d][:, None], (B, M))
        nxt, lp = draft_sample(key_d, lg, rs, fan, needs_filter=opts.needs_filter, greedy=opts.greedy,
                               c=opts.c, f_max=opts.budget)
        return (cache, _constrain(nxt, opts)), (nxt, lp)

    (cache, _), (toks, qs) = jax.lax.scan(body, (cache, t0), (jnp.arange(K), jax.random.split(key, K)))
    tree = Tree(
        k=_constrain(jnp.where(valid, kb, -1), opts),
        t=t0,
        tokens=_constrain(jnp.moveaxis(toks, 0, 2), opts),
        q=None if qs is None else _constrain(jnp.moveaxis(qs, 0, 2), opts),
    )
    return tree, _replicate(cache.with_lengths(start), opts)


def advance(params, tree: Tree, cache, n_acc_B, bonus_B, new_len_B, live_B, key, rs, fan_BxK, *, cfg, opts: Opts,
            backup: str):
    """Cache lookup for the verification outcome, plus the fallback for rows that missed.

    ``backup``: "neural" (re-draft just in time, skipped by ``lax.cond`` when every live row
    hit), "random" (point-mass random tokens) or "host" (the host merges n-gram proposals).
    Returns (next Spec, draft cache at the new committed lengths).
    """
    B, K = bonus_B.shape[0], opts.k
    match = (tree.k == n_acc_B[:, None]) & (tree.t == bonus_B[:, None])
    hit = match.any(axis=1)
    idx = jnp.argmax(match, axis=1)
    tokens = jnp.take_along_axis(tree.tokens, idx[:, None, None], axis=1)[:, 0]
    q = None if tree.q is None else jnp.take_along_axis(tree.q, idx[:, None, None, None], axis=1)[:, 0]
    cache = cache.with_lengths(new_len_B)
    n_draft = jnp.full((B,), K, jnp.int32)
    if backup == "neural":
        def redraft(cache):
            return draft_chain(params, cache, bonus_B, key, rs, fan_BxK, cfg=cfg, opts=opts)

        def keep(cache):
            return tokens, q, cache

        f_tok, f_q, cache = jax.lax.cond(jnp.any(live_B & ~hit), redraft, keep, cache)
        tokens = jnp.where(hit[:, None], tokens, f_tok)
        if q is not None:
            q = jnp.where(hit[:, None, None], q, f_q)
    elif backup == "random":
        rnd = jax.random.randint(key, (B, K), 0, opts.rand_vocab, jnp.int32)
        tokens = jnp.where(hit[:, None], tokens, rnd)
        if q is not None:
            q = mark_point_mass(q, jnp.broadcast_to(~hit[:, None], (B, K)))
    return _replicate((Spec(tokens, n_draft, q, hit), cache), opts)


def first_spec(params, cache, cur_B, key, rs, fan_BxK, *, cfg, opts: Opts, backup: str):
    """The first round's speculation (no cache yet): neural drafting or random point masses."""
    B, K = cur_B.shape[0], opts.k
    miss = jnp.zeros((B,), bool)
    if backup == "neural":
        tokens, q, cache = draft_chain(params, cache, cur_B, key, rs, fan_BxK, cfg=cfg, opts=opts)
        return _replicate((Spec(tokens, jnp.full((B,), K, jnp.int32), q, miss), cache), opts)
    tokens = jax.random.randint(key, (B, K), 0, opts.rand_vocab, jnp.int32)
    q = None if opts.greedy else jnp.full((B, K, opts.vocab), -jnp.inf, jnp.float32)
    return _replicate((Spec(tokens, jnp.full((B,), K, jnp.int32), q, miss), cache), opts)


def merge_host(spec: Spec, use_B, tokens_BxK, n_B, *, opts: Opts) -> Spec:
    """Replace the rows in ``use_B`` by host proposals (point masses, e.g. n-gram lookups)."""
    B, K = tokens_BxK.shape
    q = spec.q
    if q is not None:
        q = mark_point_mass(q, jnp.broadcast_to(use_B[:, None], (B, K)))
    out = Spec(jnp.where(use_B[:, None], tokens_BxK, spec.tokens), jnp.where(use_B, n_B, spec.n_draft), q, spec.hit)
    return _replicate(out, opts)


@functools.lru_cache(maxsize=32)
def ssd_programs(cfg, opts: Opts):
    """Compiled draft-side programs for one draft config and option set."""
    C = runtime.Compiled
    return {
        "prefill": C(functools.partial(draft_prefill, cfg=cfg), donate_argnums=(1,), name="draft_prefill"),
        "build": C(functools.partial(build_tree, cfg=cfg, opts=opts), donate_argnums=(1,), name="build"),
        **{
            f"advance_{b}": C(functools.partial(advance, cfg=cfg, opts=opts, backup=b), donate_argnums=(2,),
                              name=f"advance_{b}")
            for b in ("neural", "random", "host")
        },
        **{
            f"first_{b}": C(functools.partial(first_spec, cfg=cfg, opts=opts, backup=b), donate_argnums=(1,),
                            name=f"first_{b}")
            for b in ("neural", "random")
        },
        "merge": C(functools.partial(merge_host, opts=opts), name="merge"),
    }


# --------------------------------------------------------------------------- placement


@dataclasses.dataclass
class Placement:
    target: object  # the target model, placed
    draft: object  # the draft model, placed
    target_devices: list
    draft_devices: list
    single: bool

    def put_target(self, x):
        return jax.device_put(x, self._t_rep)

    def put_draft(self, x):
        return jax.device_put(x, self._d_rep)


def place(target, draft, spec) -> Placement:
    """Put the target on its (tensor-parallel) mesh and the draft on a disjoint mesh.

    Without device counts both share ``jax.devices()[0]`` (single-device mode).
    """
    from ssd_jax.sharding import make_mesh, replicated, shard_params, split_devices

    if spec.target_devices is None and spec.draft_devices is None:
        dev = jax.devices()[0]
        pl = Placement(target, draft, [dev], [dev], True)
        pl._t_rep = pl._d_rep = jax.sharding.SingleDeviceSharding(dev)
        return pl
    tdevs, ddevs = split_devices(spec.target_devices, spec.draft_devices, separate=True)
    tmesh, dmesh = make_mesh(tdevs), make_mesh(ddevs)
    t = dataclasses.replace(target, params=shard_params(target.cfg, target.params, tmesh))
    t.mesh = tmesh
    rep = replicated(dmesh)
    d = dataclasses.replace(draft, params=jax.tree.map(lambda x: jax.device_put(x, rep), draft.params))
    d.mesh = dmesh
    pl = Placement(t, d, list(tdevs), list(ddevs), False)
    pl._t_rep, pl._d_rep = replicated(tmesh), rep
    return pl


# --------------------------------------------------------------------------- host loop


def backup_cost_estimate(target_cfg, draft_cfg, *, batch: int, k: int, budget: int, draft_devices: int,
                         context: float, device) -> dict:
    """Build, neural re-draft and fast-backup times in units of one target verify, from the roofline model.

    Made once, before the first round, from the model shapes and the device kind (no clock is
    read), so the ``auto`` backup's per-round choice depends only on the seeded run's own
    outcomes: the same seed gives the same tokens. Reported in ``metrics["backup_model"]``.
    """
    from ssd_jax import perfmodel as pm

    itemsize = np.dtype(target_cfg.jnp_dtype).itemsize
    hw = pm.hardware_for_device(device.platform, getattr(device, "device_kind", ""), itemsize)
    tgt = pm.ModelShape.from_config("target", target_cfg)
    drf = pm.ModelShape.from_config("draft", draft_cfg)
    t_ver = pm.forward_time(hw, tgt, batch=batch, tokens=k + 1, context=context).total
    per_row = max(1, round(budget / max(1, draft_devices)))
    rerun = pm.forward_time(hw, drf, batch=batch, tokens=k + 1, context=context).total
    branch = pm.forward_time(hw, drf, batch=batch, tokens=per_row, context=context).total
    neural = k * pm.forward_time(hw, drf, batch=batch, tokens=1, context=context).total
    return {
        "hardware": hw.name,
        "t_primary": float((rerun + k * branch) / t_ver),
        "t_neural": float(neural / t_ver),
        "t_fast": float(hw.host_overhead_s / t_ver),  # host n-gram lookups and one merge call
    }


class _Means:
    """Running means with a prior (pseudo-count ``w``), for the backup decision's inputs."""

    def __init__(self, **priors):
        self._sum = {k: v * 2.0 for k, v in priors.items()}
        self._n = {k: 2.0 for k in priors}

    def add(self, name, value, n=1.0):
        self._sum[name] += value * n
        self._n[name] += n

    def __getitem__(self, name):
        return self._sum[name] / self._n[name]


def _row_schedule(est: fo.FanoutEstimator, post_miss: bool, n_draft: int, K: int, M: int, uniform: bool) -> np.ndarray:
    """Fan-out of one row: its schedule, restricted to the outcomes possible with n_draft proposals."""
    if n_draft >= K:
        return est.schedule(post_miss)
    out = np.zeros(K + 1, np.int64)
    if uniform:
        out[: n_draft + 1] = est.schedule(post_miss)[: n_draft + 1]
    else:
        out[: n_draft + 1] = fo.geometric_fanout(est.a_post if post_miss else est.a, est.r, n_draft, M)
    return out


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _measure(iv) -> float:
    return sum(b - a for a, b in iv)


def _intersection(x, y) -> float:
    """Total length of the intersection of two disjoint, sorted interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        tot += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


def generate_ssd(model, prompts, ids, sampling, spec, on_text, load, trace_path=None) -> GenerationResult:
    # the spec was validated by generate() (SpecConfig._validate_ssd): backup, fan-out, budget, C
    K = spec.k
    uniform = spec.fan_out != "geometric"
    if uniform:
        F = int(spec.fan_out)
        M = F * (K + 1)
    else:
        # default: two branches per acceptance position, rounded up to fill every draft device
        n_dd = 1 if spec.target_devices is None and spec.draft_devices is None else (spec.draft_devices or 1)
        M = spec.fan_out_budget if spec.fan_out_budget is not None else -(-2 * (K + 1) // n_dd) * n_dd

    draft = load(spec.draft) if isinstance(spec.draft, str) else spec.draft
    check_same_tokenizer(model, draft)
    rows_prompt = [p for p in prompts for _ in range(sampling.n)]
    rows_ids = [x for x in ids for _ in range(sampling.n)]
    B = len(rows_ids)
    width, max_len = plan_batch(model, rows_ids, sampling, spec)
    plan_batch(draft, rows_ids, sampling, spec)
    pl = place(model, draft, spec)
    target, draft = pl.target, pl.draft
    if M % len(pl.draft_devices) and not pl.single:
        raise UserError(
            f"the fan-out budget ({M} branches) must divide over the {len(pl.draft_devices)} draft devices"
        )
    eos = eos_ids(model)
    rows = [RowState(p, i, model, sampling, eos) for p, i in zip(rows_prompt, rows_ids)]
    greedy = sampling.temperature == 0
    tok = model.tokenizer
    opts = Opts(
        k=K, budget=M, vocab=model.cfg.vocab_size,
        rand_vocab=tok.vocab_size if tok is not None else model.cfg.vocab_size,
        needs_filter=sampling.needs_filter, greedy=greedy, c=float(spec.saguaro_c), tree_base=max_len,
        mesh=None if pl.single else draft.mesh,
    )
    prog = ssd_programs(draft.cfg, opts)
    prefill, _ = runtime.ar_steps(target.cfg, sampling.needs_filter)
    score, acc = sd_steps(target.cfg, sampling.needs_filter)
    tput, dput = pl.put_target, pl.put_draft

    tokens = np.zeros((B, width), np.int32)
    for b, r in enumerate(rows_ids):
        tokens[b, : len(r)] = r
    n_valid = np.array([len(r) for r in rows_ids], np.int32)
    rs_host = RowSampling.broadcast(sampling, B)
    rs_t, rs_d = jax.tree.map(tput, rs_host), jax.tree.map(dput, rs_host)
    key_data = jax.random.key_data(jax.random.key(sampling.seed))
    key_t = jax.random.wrap_key_data(tput(key_data))
    key_d = jax.random.wrap_key_data(dput(key_data))
    kverify, kdraft = jax.random.fold_in(key_t, 2), jax.random.fold_in(key_d, 1)

    tcache = _cache_for(target, B, max_len)
    dcache = llama.init_cache(draft.cfg, B, max_len + M * K)
    dcache = jax.tree.map(dput, dcache)
    est = fo.FanoutEstimator(K, M, "uniform" if uniform else "geometric", uniform_F=F if uniform else None)
    tl = Timeline(enabled=True)
    tlane, dlane = lane_for(pl.target_devices), lane_for(pl.draft_devices)

    # --- compile everything up front
    tok_d, nval_d = tput(tokens), tput(n_valid)
    compile_s = prefill.precompile(target.params, tcache, tok_d, nval_d, key_t, rs_t)
    dtok, dnval = dput(tokens), dput(n_valid)
    compile_s += prog["prefill"].precompile(draft.params, dcache, dtok, dnval)
    zB_t, zB_d = tput(np.zeros(B, np.int32)), dput(np.zeros(B, np.int32))
    zK_t, zK_d = tput(np.zeros((B, K), np.int32)), dput(np.zeros((B, K), np.int32))
    fan0 = dput(np.ones((B, K), np.int32))
    kbM = dput(np.zeros((B, M), np.int32))
    bool_d = dput(np.zeros(B, bool))
    V = model.cfg.vocab_size
    q_t = None if greedy else tput(np.zeros((B, K, V), np.float32))
    step_t = tput(np.int32(0))
    compile_s += score.precompile(target.params, tcache, zB_t, zK_t)
    compile_s += acc.precompile(kverify, step_t, tput(np.zeros((B, K + 1, V), np.float32)), zK_t, zB_t, q_t, rs_t,
                                zB_t, zB_t)
    # one real build on the empty cache (its writes are overwritten by the prefill) gives a tree
    # with the exact shardings the loop will pass to advance
    a = time.perf_counter()
    tree0, dcache = prog["build"](draft.params, dcache, zB_d, zK_d, zB_d, kbM, kbM, fan0, kdraft, rs_d)
    jax.block_until_ready(tree0)
    compile_s += time.perf_counter() - a
    kinds = {"neural": ["neural"], "random": ["random"], "ngram": ["host"], "auto": ["neural", "host"]}[spec.backup]
    for kind in kinds:
        compile_s += prog[f"advance_{kind}"].precompile(draft.params, tree0, dcache, zB_d, zB_d, zB_d, bool_d, kdraft,
                                                        rs_d, fan0)
    first_kind = "random" if spec.backup == "random" else "neural"
    compile_s += prog[f"first_{first_kind}"].precompile(draft.params, dcache, zB_d, kdraft, rs_d, fan0)
    if "host" in kinds:
        spec0 = Spec(zK_d, zB_d, None if greedy else dput(np.zeros((B, K, V), np.float32)), bool_d)
        compile_s += prog["merge"].precompile(spec0, bool_d, zK_d, zB_d)
    del tree0

    # --- prefill both models (both count towards ttft), then the first speculation
    t0 = time.perf_counter()
    cur_t, tcache = prefill(target.params, tcache, tok_d, nval_d, key_t, rs_t)
    tl.record("prefill", tlane, cur_t, round=0)
    dcache = prog["prefill"](draft.params, dcache, dtok, dnval)
    tl.record("draft_prefill", dlane, dcache.lengths, round=0)
    first = np.asarray(cur_t)
    ttft = time.perf_counter() - t0
    for b, r in enumerate(rows):
        new = r.push(int(first[b]))
        if new and on_text is not None:
            on_text(b, new)
    cur_d = dput(first)
    fan_next = np.broadcast_to(est.schedule(False)[:K], (B, K)).astype(np.int32)
    sp, dcache = prog[f"first_{first_kind}"](draft.params, dcache, cur_d, jax.random.fold_in(kdraft, 0), rs_d,
                                             dput(fan_next))
    tl.record(f"fallback_{first_kind}", dlane, sp.tokens, round=0)
    history = [np.asarray(list(r) + [int(first[b])], np.int32) for b, r in enumerate(rows_ids)]

    stats = AcceptanceStats(B, K)
    live = np.array([not r.done for r in rows])
    n_draft_h = np.full(B, K, np.int64)
    post_miss = np.full(B, first_kind != "neural")  # the speculation came from a fast fallback
    from_cache = np.zeros(B, bool)
    fallback_calls = {"neural": 1 if first_kind == "neural" else 0, "ngram": 0, "random": int(first_kind == "random")}
    hits = np.zeros(B, np.int64)
    lookups = np.zeros(B, np.int64)
    tau = {"hit": [0, 0], "miss": [0, 0]}  # tokens, rounds
    # the backup decision's inputs: token statistics of this run (running means with a prior) and
    # stage costs estimated once from the model shapes, never from clocks (seeded runs reproduce)
    means = _Means(p_hit=0.6, e_hit=1 + 0.7 * K, e_neural=1 + 0.7 * K, e_fast=1.2)
    costs = backup_cost_estimate(target.cfg, draft.cfg, batch=B, k=K, budget=M, draft_devices=len(pl.draft_devices),
                                 context=max(n_valid) + sampling.max_new_tokens / 2, device=pl.draft_devices[0])
    b_star = None
    batch_all_hit = [0, 0]
    step = 0
    while live.any():
        step += 1
        fan_rows = np.where(post_miss[:, None], est.schedule(True), est.schedule(False))
        short: dict = {}
        for b in np.flatnonzero(n_draft_h < K):  # n-gram proposals shorter than K: fewer outcomes
            key_b = (bool(post_miss[b]), int(n_draft_h[b]))
            if key_b not in short:
                short[key_b] = _row_schedule(est, *key_b, K, M, uniform)
            fan_rows[b] = short[key_b]
        kb, rb = fo.branch_layout(fan_rows, M)
        fan_next = np.broadcast_to(est.schedule(False)[:K], (B, K)).astype(np.int32)
        # target: verify the current speculation (only the speculation crosses to the target)
        spec_t = jax.tree.map(tput, sp) if not pl.single else sp
        logits, tcache = score(target.params, tcache, cur_t, spec_t.tokens)
        tl.record("verify", tlane, logits, round=step)
        # draft: build the cache for the next round while the target verifies
        tree, dcache = prog["build"](draft.params, dcache, cur_d, sp.tokens, sp.n_draft, dput(kb), dput(rb),
                                     dput(fan_next), jax.random.fold_in(kdraft, 2 * step), rs_d)
        tl.record("build", dlane, tree.tokens, round=step)
        emitted, n_acc, new_len, _, _, cur_t = acc(kverify, tput(np.int32(step)), logits, spec_t.tokens,
                                                   spec_t.n_draft, spec_t.q, rs_t, tcache.lengths, cur_t)
        tl.record("sample", tlane, cur_t, round=step)
        tcache = tcache.with_lengths(new_len)
        # only the outcome crosses back: (k, bonus, new length) per row
        n_acc_d, cur_d, len_d = (dput(x) for x in (n_acc, cur_t, new_len))
        n_live = int(live.sum())
        if spec.backup == "auto":
            b_star = fo.critical_batch_size(means["p_hit"], means["e_hit"], means["e_neural"], means["e_fast"],
                                            costs["t_primary"], costs["t_neural"], costs["t_fast"])
            kind = "neural" if n_live < b_star else "host"
        else:
            kind = kinds[0]
        sp, dcache = prog[f"advance_{kind}"](draft.params, tree, dcache, n_acc_d, cur_d, len_d, dput(live),
                                             jax.random.fold_in(kdraft, 2 * step + 1), rs_d, dput(fan_next))
        tl.record("advance", dlane, sp.tokens, round=step)
        # the round's one blocking read: outcome, hits, emitted tokens
        emitted_h, n_acc_h, hit_h = np.asarray(emitted), np.asarray(n_acc), np.asarray(sp.hit)
        tl.flush()

        # statistics over the live rows of this round
        stats.update(live, n_acc_h, n_draft_h, hit=from_cache)
        emitted_n = n_acc_h + 1
        for name, sel in (("hit", from_cache & live), ("miss", ~from_cache & live)):
            tau[name][0] += int(emitted_n[sel].sum())
            tau[name][1] += int(sel.sum())
        if (from_cache & live).any():
            means.add("e_hit", float(emitted_n[from_cache & live].mean()))
        neural_rows = ~from_cache & ~post_miss & live
        if neural_rows.any():
            means.add("e_neural", float(emitted_n[neural_rows].mean()))
        if (post_miss & live).any():
            means.add("e_fast", float(emitted_n[post_miss & live].mean()))
        est.observe(n_acc_h[live], n_draft_h[live], hit_h[live], fan_rows[live], post_miss[live])
        batch_all_hit[0] += int(hit_h[live].all())
        batch_all_hit[1] += 1
        means.add("p_hit", float(hit_h[live].mean()), n=float(live.sum()) / max(B, 1))

        push_round(rows, live, emitted_h, n_acc_h, on_text, history)
        # the hit rate counts the lookups whose speculation is verified next (rows still live)
        hits += hit_h & live
        lookups += live
        missed = ~hit_h & live
        from_cache = hit_h.copy()
        if not missed.any():
            post_miss[:] = False
            n_draft_h[:] = K
            continue
        if kind == "neural":
            fallback_calls["neural"] += 1
            post_miss[:] = False
            n_draft_h[:] = K
        elif kind == "random":
            fallback_calls["random"] += 1
            post_miss = missed.copy()
            n_draft_h[:] = K
        else:  # n-gram lookups on the host for the rows that missed
            a = time.perf_counter()
            ng = np.zeros((B, K), np.int32)
            ng_n = np.zeros(B, np.int32)
            for b in np.flatnonzero(missed):
                got = ngram_lookup(history[b], K, spec.prompt_lookup_min, spec.prompt_lookup_max)
                ng[b, : len(got)] = got
                ng_n[b] = len(got)
            sp = prog["merge"](sp, dput(missed), dput(ng), dput(ng_n))
            tl.mark("ngram", "host", round=step, start=a, end=time.perf_counter())
            fallback_calls["ngram"] += 1
            post_miss = missed.copy()
            n_draft_h = np.where(missed, ng_n, K)
    wall = time.perf_counter() - t0
    jax.block_until_ready(sp.tokens)
    tl.close()
    if trace_path:
        tl.write_chrome(trace_path)

    events = tl.events()
    dur = {}
    for e in events:
        dur[e["name"]] = dur.get(e["name"], 0.0) + (e["end"] - e["start"])
    # draft time the target waited for: draft work (build, advance, fallbacks) while the target
    # lane was idle; in single-device mode that is all of it, with perfect overlap none of it
    tgt = [(e["start"], e["end"]) for e in events if e["round"] > 0 and e["name"] in ("verify", "sample")]
    drf = [(e["start"], e["end"]) for e in events if e["round"] > 0 and e["name"] not in ("verify", "sample")]
    exposed = _measure(_union(drf)) - _intersection(_union(drf), _union(tgt))
    verify_s, sample_s = dur.get("verify", 0.0), dur.get("sample", 0.0)
    draft_s = sum(v for k_, v in dur.items() if k_ in ("build", "advance") or k_.startswith("fallback"))
    outputs = []
    for b, r in enumerate(rows):
        o = r.output()
        o["metrics"] = {**stats.row_metrics(b), "cache_hit_rate": float(hits[b] / lookups[b]) if lookups[b] else 0.0}
        outputs.append(o)
    metrics = {
        **speed_metrics(rows, wall, ttft, compile_s, n_valid),
        "k": K,
        "draft": draft.name,
        "verify_steps": step,
        **stats.metrics(),
        "cache_hit_rate": float(hits.sum() / lookups.sum()) if lookups.sum() else 0.0,
        "batch_cache_hit_rate": batch_all_hit[0] / batch_all_hit[1] if batch_all_hit[1] else 0.0,
        "tau_hit": tau["hit"][0] / tau["hit"][1] if tau["hit"][1] else 0.0,
        "tau_miss": tau["miss"][0] / tau["miss"][1] if tau["miss"][1] else 0.0,
        "fanout": {"mode": "uniform" if uniform else "geometric", "budget": M, "schedule": est.schedule(False).tolist(),
                   "post_miss_schedule": est.schedule(True).tolist(), **est.to_dict()},
        "saguaro_c": float(spec.saguaro_c),
        "backup": spec.backup,
        "b_star": b_star,
        "backup_model": costs,
        "fallback_calls": fallback_calls,
        "draft_s": draft_s,
        "draft_exposed_s": exposed,
        "verify_s": verify_s,
        "sample_s": sample_s,
        "overhead_s": max(0.0, wall - ttft - verify_s - sample_s - exposed),
        "overlap_fraction": tl.overlap_fraction("verify", "build"),
        "prefill_s": ttft,
        "devices": {"single_device": pl.single, "target": len(pl.target_devices), "draft": len(pl.draft_devices)},
    }
    return GenerationResult(outputs, metrics, method="ssd")
