"""EAGLE-style draft heads (ssd_jax/drafters/eagle.py) on tiny models: the training view (every
position and draft step at once, under the decode-time mask) equals the decode-time drafting, and
training lowers the loss and raises the greedy acceptance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sd import tiny_model

from ssd_jax.drafters import eagle
from ssd_jax.models import llama


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, layers=4)


def test_training_view_equals_decode_time_drafting(target):
    """For one sequence, the head's step-d log-probabilities at position j from the unrolled training
    view equal those of drafting after a prefill of pairs 0..j-1, pending pair j, own outputs fed back
    (the drafted tokens forced to the sequence's own, so both views see the same tokens)."""
    cfg, tp = target.cfg, target.params
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    head = eagle.init_head(cfg, spec, seed=3, scale=0.2)
    T, K, j = 14, 3, 6
    toks = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (1, T)), jnp.int32)
    feats, _ = eagle.target_features(tp, cfg, toks, spec.layers)
    unrolled = eagle.unrolled_logits(head, tp, cfg, toks, feats, K)

    cache = eagle.init_head_cache(cfg, 1, 64)
    _, _, cache = eagle.head_forward(head, tp, cfg, toks[:, 1 : j + 1], feats[:, :j], cache, own=False)
    cache = cache.with_lengths(cache.lengths + j)  # pairs 0..j-1 committed

    def forced(key, lg, d):  # the sequence's own token, and the head's log-probabilities as "q"
        return toks[:, j + 2 + d], jax.nn.log_softmax(lg, axis=-1)

    pend_tok = toks[:, j + 1 : j + 2]
    pend_feat = feats[:, j : j + 1]
    _, q, cache = eagle.head_draft(
        head, tp, cache, pend_tok, pend_feat, jnp.ones(1, jnp.int32), jax.random.split(jax.random.key(0), K),
        forced, cfg=cfg, vocab=cfg.vocab_size,
    )  # fmt: skip
    assert int(cache.lengths[0]) == j + 1
    for d in range(K):
        np.testing.assert_allclose(np.asarray(q[0, d]), np.asarray(unrolled[d][0, j]), atol=2e-4)


def test_capture_returns_the_layers_outputs(target):
    cfg, tp = target.cfg, target.params
    toks = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
    h, _, f = llama.forward(tp, cfg, toks, llama.init_cache(cfg, 1, 8), capture=(cfg.num_layers - 1,))
    h2, _ = llama.forward(tp, cfg, toks, llama.init_cache(cfg, 1, 8))
    np.testing.assert_allclose(np.asarray(h), np.asarray(h2), atol=1e-6)
    # the last layer's output, normed, is the final hidden state
    np.testing.assert_allclose(
        np.asarray(llama.rms_norm(f, tp["final_norm"], cfg.rms_norm_eps)), np.asarray(h), atol=1e-5
    )


def test_training_lowers_the_loss_and_raises_acceptance(target):
    """Adam on the target's own greedy continuations of random prompts: the KL falls and the head's
    teacher-forced greedy acceptance (K = 3) rises well above the untrained head's."""
    import optax

    from ssd_jax import SamplingParams, generate

    cfg, tp = target.cfg, target.params
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, cfg.vocab_size, 6).tolist() for _ in range(16)]
    res = generate(target, prompts, SamplingParams(max_new_tokens=26, ignore_eos=True))
    seqs = np.array([p + o["token_ids"] for p, o in zip(prompts, res.outputs)], np.int32)
    mask = np.zeros(seqs.shape, np.float32)
    mask[:, 5:-1] = 1.0  # token j + 1 is generated for j >= 5
    toks, mask = jnp.asarray(seqs), jnp.asarray(mask)

    head = eagle.init_head(cfg, spec, seed=0)
    opt = optax.adam(3e-3)
    step = eagle.make_head_step(cfg, spec, 2, opt)

    def accept(h):
        ok, w = eagle.greedy_acceptance(h, tp, toks, mask, cfg=cfg, spec=spec, k=3)
        return float((ok * w).sum() / w.sum())

    before = accept(head)
    state = opt.init(head)
    losses = []
    for _ in range(60):
        head, state, loss, _ = step(head, state, tp, toks, mask)
        losses.append(float(loss))
    after = accept(head)
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert after > max(0.8, before + 0.7), (before, after)  # mean accepted of K = 3 per scored position
