"""SSD with an EAGLE-style head (ssd_jax/decoding/ssd/head.py) on tiny models: every branch of the tree
is what the head drafts directly from the pending pairs, its own features for the re-run speculation
and the branch's bonus token; greedy SSD with a head equals AR (a head that shadows the target hits
every round); sampled SSD with a head follows the target (slow, with its biased control); a head's
cached-feature training step equals the live one."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_eagle import _saved_head
from test_sd import tiny_model

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.decoding.sd_eagle import Pending
from ssd_jax.decoding.ssd.head import head_tree
from ssd_jax.decoding.ssd.tree import Opts
from ssd_jax.drafters import eagle
from ssd_jax.models import llama

PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
# jitted: op by op, every primitive would compile on its own (most of the tree test's time)
_fwd = jax.jit(eagle.head_forward, static_argnums=2, static_argnames="own")
_logits = jax.jit(eagle.head_logits, static_argnums=2)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, layers=4)


def _greedy_branch(head, tp, cfg, hc, pend, spec_tokens, k, t, K):
    """The reference: the head over the pending pairs, its own features over s_1..s_k, then K greedy
    steps from (its feature at s_k, t), one call per step at the natural positions."""
    _, g, hc = _fwd(head, tp, cfg, pend.tok, pend.feat, hc, own=False)
    L = hc.lengths + pend.n
    gk = g[:, int(pend.n[0]) - 1]
    for d in range(k):
        _, g, hc = _fwd(
            head, tp, cfg, spec_tokens[:, d : d + 1], gk[:, None], hc.with_lengths(L + d), own=True
        )
        gk = g[:, 0]
    tok, out = jnp.asarray([t], jnp.int32), []
    for d in range(K):
        h, g, hc = _fwd(head, tp, cfg, tok[:, None], gk[:, None], hc.with_lengths(L + k + d), own=True)
        tok, gk = jnp.argmax(_logits(head, tp, cfg, h[:, 0]), -1).astype(jnp.int32), g[:, 0]
        out.append(int(tok[0]))
    return out


def test_tree_branches_are_the_heads_own_drafts(target):
    """Every valid branch (k, t) of :func:`head_tree` (greedy) holds the K tokens the head drafts from the
    committed pairs, its own features over s_1..s_k and the bonus t: the tree's masks, positions and
    feature hand-over against step-by-step drafting."""
    cfg, tp = target.cfg, target.params
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    head = eagle.init_head(cfg, spec, seed=2, scale=0.3)
    K, M, max_len = 3, 6, 48
    rng = np.random.default_rng(0)
    # a head cache holding 6 committed pairs, 2 pending pairs with the target's features, a speculation
    toks = jnp.asarray(rng.integers(2, cfg.vocab_size, (1, 9)), jnp.int32)
    _, _, feats = llama.forward(tp, cfg, toks, llama.init_cache(cfg, 1, 9), capture=spec.layers)
    hc0 = eagle.init_head_cache(cfg, 1, max_len + M * K)
    _, _, hc0 = _fwd(head, tp, cfg, toks[:, 1:7], feats[:, :6], hc0, own=False)
    hc0 = hc0.with_lengths(jnp.asarray([6], jnp.int32))
    pend = Pending(toks[:, 7:9], feats[:, 6:8], jnp.asarray([2], jnp.int32))
    spec_tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (1, K)), jnp.int32)
    kb = jnp.asarray([[0, 0, 1, 2, 3, -1]], jnp.int32)  # -1: an unused branch
    rb = jnp.asarray([[0, 1, 0, 0, 0, 0]], jnp.int32)
    opts = Opts(k=K, budget=M, vocab=cfg.vocab_size, rand_vocab=cfg.vocab_size, needs_filter=False,
                greedy=True, c=1.0, tree_base=max_len)  # fmt: skip
    from ssd_jax.sampling.filters import RowSampling

    rs = RowSampling(np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32), np.zeros(1, np.int32),
                     np.full((1, 1), -1, np.int32), np.zeros(1, bool))  # fmt: skip
    tree, hc = jax.jit(head_tree, static_argnames=("cfg", "opts"))(
        head, tp, hc0, pend, spec_tokens, jnp.asarray([K], jnp.int32), kb, rb, jnp.full((1, K), 2, jnp.int32),
        jax.random.key(0), rs, cfg=cfg, opts=opts,
    )  # fmt: skip
    assert int(hc.lengths[0]) == 8  # the committed length: 6 pairs + the 2 pending ones
    assert int(tree.k[0, M - 1]) == -1  # no key: never matched
    for m in range(M - 1):
        k, t = int(tree.k[0, m]), int(tree.t[0, m])
        assert k == int(kb[0, m]) and (k == K or t != int(spec_tokens[0, k]))  # s_{k+1} is no bonus
        ref = _greedy_branch(head, tp, cfg, hc0, pend, spec_tokens, k, t, K)
        assert np.asarray(tree.tokens[0, m]).tolist() == ref, (m, k, t)


def _shadow(seed=3):
    """A one-layer target without attention output (each position's features depend on its token only)
    whose embedding rows have unit RMS, and a head that is a copy of it: its input is the next token's
    embedding, its layer the target's, so its output is the target's features there and its
    distribution the target's. SD with it accepts everything; SSD with it hits every round."""
    t = tiny_model(seed, layers=1)
    cfg, p = t.cfg, dict(t.params)
    V, D = cfg.vocab_size, cfg.hidden_size
    E = np.asarray(p["embed"], np.float32)
    ax = 1 if E.shape == (V, D) else 0
    E = E / np.sqrt((E**2).mean(axis=ax, keepdims=True) + cfg.rms_norm_eps)
    layer = {**p["layers"][0], "wo": jnp.zeros_like(p["layers"][0]["wo"])}
    t = dataclasses.replace(t, params={**p, "embed": jnp.asarray(E, p["embed"].dtype), "layers": [layer]})
    spec = eagle.HeadSpec((0,))
    w_in = np.zeros((2 * D, D), np.float32)
    w_in[:D] = np.eye(D)
    head = {
        **eagle.init_head(cfg, spec),
        "w_in": jnp.asarray(w_in),
        "layer": dict(layer),
        "norm_o": p["final_norm"],
    }
    return t, head, spec


def test_greedy_ssd_with_a_head_equals_ar(target, tmp_path):
    """Greedy SSD with a head emits AR's tokens, with a random head (it misses) and with a head that
    shadows its target (every proposal accepted, every lookup a hit: the tree's keys and branches line
    up with the verify's outcomes)."""
    sp = SamplingParams(max_new_tokens=14, ignore_eos=True)
    cfg = target.cfg
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    rand = _saved_head(tmp_path, target, eagle.init_head(cfg, spec, seed=5, scale=0.2), spec)
    ar = [o["token_ids"] for o in generate(target, PROMPTS, sp).outputs]
    res = generate(target, PROMPTS, sp, spec=SpecConfig(method="ssd", draft=rand, k=3))
    assert [o["token_ids"] for o in res.outputs] == ar
    assert res.metrics["calls_per_round"] == 1 and 0 <= res.metrics["cache_hit_rate"] <= 1
    shadow, head, hspec = _shadow()
    d = _saved_head(tmp_path, shadow, head, hspec, name="shadow")
    ar = [o["token_ids"] for o in generate(shadow, PROMPTS, sp).outputs]
    res = generate(shadow, PROMPTS, sp, spec=SpecConfig(method="ssd", draft=d, k=3))
    assert [o["token_ids"] for o in res.outputs] == ar
    assert res.metrics["acceptance_rate"] == 1.0 and res.metrics["cache_hit_rate"] == 1.0
    assert res.metrics["tau_hit"] == 4.0


@pytest.mark.slow
@pytest.mark.parametrize("biased", [False, True])
def test_sampled_ssd_with_a_head_follows_the_target(tmp_path, monkeypatch, biased):
    """Every token SSD with a briefly trained head emits at T = 1 (hits and neural fallbacks) is scored
    against the target's conditional (test_exactness's goodness-of-fit test); the verifier that draws the
    bonus from the draft's q (the control) must fail it."""
    from test_eagle import sampled_with_head

    res, rep = sampled_with_head(tmp_path, monkeypatch, "ssd", biased)
    if biased:
        assert rep.rejected, f"the biased engine passed: {rep}"
        return
    assert not rep.rejected, str(rep)
    assert 0.05 < res.metrics["cache_hit_rate"] < 1.0 and res.metrics["fallback_calls"]["neural"] > 0


# slow (default-suite budget): the cache's contents are checked in the default set
# (test_feature_cache_round_trips...), the step's loss here
@pytest.mark.slow
@pytest.mark.parametrize("trimmed", [True, False])
def test_cached_feature_step_equals_the_live_one(target, trimmed):
    """The loss and gradient of a step from stored target outputs (the cache keeps the features in
    bfloat16; here float32) equal the live step's, with a trimmed vocabulary (the full one: slow)."""
    cfg, tp = target.cfg, target.params
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    head = eagle.init_head(cfg, spec, seed=1, scale=0.2, mlp=48)
    assert head["layer"]["w_gate"].shape[0] == 48
    rng = np.random.default_rng(1)
    toks = jnp.asarray(rng.integers(2, cfg.vocab_size, (2, 12)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 12)) < 0.7, jnp.float32)
    f, h, lse, top = eagle.cached_targets(tp, cfg, toks, spec.layers)
    ids = jnp.arange(0, cfg.vocab_size, 2) if trimmed else None
    live, lg = jax.value_and_grad(
        lambda hd: eagle.head_loss(hd, tp, toks, mask, ids, cfg=cfg, spec=spec, depth=2)[0]
    )(head)
    cached, cg = jax.value_and_grad(
        lambda hd: eagle.head_loss_cached(hd, tp, toks, f, h, lse, top, mask, ids, cfg=cfg, depth=2)[0]
    )(head)
    np.testing.assert_allclose(float(cached), float(live), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6), cg, lg)


def test_feature_cache_round_trips_and_is_never_half_built(target, tmp_path):
    """The feature cache holds the target's outputs for every window (features in bfloat16), a rebuild
    from the same windows reuses it, other windows are refused, and a killed build's directory is never
    taken for a cache."""
    from ssd_jax.errors import UserError
    from ssd_jax.training.eagle_cache import CACHE_DIR, FeatureCache, build_cache

    cfg = target.cfg
    layers = eagle.default_layers(cfg.num_layers)
    rng = np.random.default_rng(3)
    toks = rng.integers(2, cfg.vocab_size, (5, 16)).astype(np.int32)
    w = (rng.random((5, 16)) < 0.8).astype(np.float32)
    (tmp_path / f"{CACHE_DIR}.tmp-1").mkdir()  # a killed build
    path = build_cache(tmp_path, target, layers, toks, w, chunk=2, log=lambda m: None)
    assert not list(tmp_path.glob(f"{CACHE_DIR}.tmp-*"))
    cache = FeatureCache(path)
    t, f, h, lse, top, ww = cache.batch([3, 1])
    f_ref, h_ref, lse_ref, top_ref = eagle.cached_targets(
        target.params, cfg, jnp.asarray(toks[[1, 3]]), layers
    )
    np.testing.assert_array_equal(t, toks[[1, 3]])
    np.testing.assert_array_equal(ww, w[[1, 3]])
    np.testing.assert_array_equal(top, np.asarray(top_ref))
    np.testing.assert_allclose(lse, np.asarray(lse_ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(f, np.float32), np.asarray(f_ref), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h_ref), rtol=1e-2, atol=1e-2)
    assert build_cache(tmp_path, target, layers, toks, w) == path  # the same windows: reused
    with pytest.raises(UserError, match="other windows"):
        build_cache(tmp_path, target, layers, toks[:4], w[:4])


def test_eagle_cli_takes_the_cache_and_head_options():
    """``python -m ssd_jax.train eagle`` parses the options ``make eagle-qwen`` passes."""
    from ssd_jax.cli.train import build_eagle_parser

    a = build_eagle_parser().parse_args(
        ["--target", "t", "--out", "o", "--corpus-rows", "4", "--cached-windows", "384", "--head-mlp", "3072",
         "--save-dtype", "bfloat16"]
    )  # fmt: skip
    assert (a.data, a.cached_windows, a.head_mlp, a.save_dtype) == (None, 384, 3072, "bfloat16")
    b = build_eagle_parser().parse_args(["--target", "t", "--out", "o", "--init", "qwen2.5-coder-1.5b-eagle"])
    assert (a.init, b.init) == (None, "qwen2.5-coder-1.5b-eagle")


def test_warm_start_takes_a_trained_heads_weights_or_refuses(target, tmp_path):
    """``--init HEAD`` starts training from a trained head's weights (exactly, as float32); a head of
    another MLP width, other layers or another kept vocabulary is refused in one line."""
    from ssd_jax.errors import UserError
    from ssd_jax.training.eagle_train import warm_start

    cfg = target.cfg
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    trained = eagle.init_head(cfg, spec, seed=7, mlp=32)
    ids = np.arange(0, cfg.vocab_size, 2, dtype=np.int32)
    src = _saved_head(tmp_path, target, trained, spec, vocab_ids=ids)[len("eagle:") :]
    start, rec = warm_start(eagle.init_head(cfg, spec, seed=0, mlp=32), src, target, spec, ids)
    jax.tree.map(np.testing.assert_array_equal, start, trained)
    assert rec["from"] == src and len(rec["sha256"]) == 64
    with pytest.raises(UserError, match="shapes differ"):
        warm_start(eagle.init_head(cfg, spec), src, target, spec, ids)
    with pytest.raises(UserError, match="vocabulary differs"):
        warm_start(eagle.init_head(cfg, spec, mlp=32), src, target, spec, None)
    other = eagle.HeadSpec(tuple(x for x in range(cfg.num_layers) if x not in spec.layers)[:2] or (0,))
    with pytest.raises(UserError, match="reads layers"):
        warm_start(eagle.init_head(cfg, other, mlp=32), src, target, other, ids)
