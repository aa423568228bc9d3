"""Log-probabilities of emitted tokens and min_tokens (ssd_jax/sampling/logprobs.py) through the one engine:
every method returns the target's raw log-probabilities of the tokens it emits (the same numbers as a
full forward of the target), and min_tokens bans EOS exactly as the reference masks it, for AR, SD
(model and n-gram drafts) and SSD."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import SPECS
from test_sd import tiny_model

from ssd_jax import SamplingParams, generate
from ssd_jax.models import llama
from ssd_jax.sampling import logprobs as L
from ssd_jax.errors import UserError

PROMPTS = [[3, 4, 5, 6, 7], [9, 10, 11]]


@pytest.fixture(scope="module")
def pair():
    return tiny_model(0), tiny_model(1, scale=0.16)


@functools.partial(jax.jit, static_argnums=1)
def _full_logprobs(params, cfg, ids):
    h, _ = llama.forward(params, cfg, ids, llama.init_cache(cfg, 1, ids.shape[1]))
    return jax.nn.log_softmax(llama.logits(params, cfg, h)[0].astype(jnp.float32), axis=-1)


def _reference_logprobs(model, prompt, tokens):
    """log_softmax of the target's logits over the full sequence at each generated position (one
    causal forward, right-padded to a multiple of 16 so a few compiled widths serve every call)."""
    seq = list(prompt) + list(tokens)
    ids = jnp.asarray([seq + [0] * (-len(seq) % 16)], jnp.int32)
    logp = _full_logprobs(model.params, model.cfg, ids)
    return np.array(logp[len(prompt) - 1 : len(prompt) - 1 + len(tokens)])


def test_pack_unpack_and_ban_are_exact():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3, 50)), jnp.float32)
    toks = jnp.asarray([[4, 7, -1], [0, 49, 3]], jnp.int32)
    lp, ids, top = L.token_logprobs(logits, toks, top=5)
    host = L.unpack(np.asarray(L.pack(lp, ids, top)), 3)
    chex.assert_trees_all_equal(
        (host.lp, host.top_ids, host.top_lp), tuple(np.asarray(x) for x in (lp, ids, top))
    )
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(host.lp[0, :2], ref[0, [0, 1], [4, 7]], rtol=1e-6)
    assert (np.diff(host.top_lp, axis=-1) <= 0).all() and host.top_ids[1, 1, 0] == ref[1, 1].argmax()
    # ban ids 5 and 9 (row 0) / none (row 1) before position 11: positions 10, 11, 12 per row
    pos = jnp.asarray([[10, 11, 12], [10, 11, 12]])
    ban = jnp.asarray([[5, 9], [-1, -1]], jnp.int32)
    out = np.asarray(L.ban_early_eos(logits, pos, jnp.asarray([11, 11]), ban))
    assert np.isneginf(out[0, 0, [5, 9]]).all()
    np.testing.assert_array_equal(np.delete(out[0, 0], [5, 9]), np.delete(np.asarray(logits)[0, 0], [5, 9]))
    np.testing.assert_array_equal(out[0, 1:], np.asarray(logits)[0, 1:])
    np.testing.assert_array_equal(out[1], np.asarray(logits)[1])


# the default set keeps AR here (the slow set runs all four): the verify's log-probabilities are
# checked by default over HTTP (test_serve: the SD server's equal offline AR's)
@pytest.mark.parametrize(
    "method", ["ar", *(pytest.param(m, marks=pytest.mark.slow) for m in ("sd", "ngram", "ssd"))]
)
def test_logprobs_are_the_targets_for_every_method(pair, method):
    """Greedy: each emitted token's log-probability and the top 4 equal a full forward's log_softmax, for
    every method (speculation returns the numbers AR returns)."""
    target, draft = pair
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=4)
    res = generate(target, PROMPTS, sp, SPECS[method](draft))
    for prompt, o in zip(PROMPTS, res.outputs):
        ref = _reference_logprobs(target, prompt, o["token_ids"])
        assert len(o["logprobs"]) == len(o["token_ids"]) == 8
        for j, (t, (lp, top)) in enumerate(zip(o["token_ids"], o["logprobs"])):
            np.testing.assert_allclose(lp, ref[j, t], atol=2e-5)
            assert [i for i, _ in top] == list(np.argsort(-ref[j], kind="stable")[:4])
            np.testing.assert_allclose([x for _, x in top], np.sort(ref[j])[::-1][:4], atol=2e-5)
    plain = generate(target, PROMPTS, dataclasses.replace(sp, logprobs=None), SPECS[method](draft))
    assert all("logprobs" not in o or o["logprobs"] is None for o in plain.outputs)
    assert [o["token_ids"] for o in plain.outputs] == [o["token_ids"] for o in res.outputs]


def _with_eos(model, eos: int):
    return dataclasses.replace(model, cfg=model.cfg.replace(eos_token_ids=(eos,)))


@pytest.mark.parametrize(
    "method", ["ar", "sd", *(pytest.param(m, marks=pytest.mark.slow) for m in ("ngram", "ssd"))]
)
def test_min_tokens_bans_eos_as_the_reference_does(pair, method):
    """The target's greedy token at step 2 made its EOS: without min_tokens the row stops there; with
    min_tokens 6 it runs on and its tokens are the argmax of the logits with EOS masked before position
    6 (a naive full forward per step), for every method."""
    target, draft = pair
    free = generate(target, [PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True)).outputs[0][
        "token_ids"
    ]
    eos = next(t for j, t in enumerate(free) if j >= 2 and t not in free[:j])
    stop_at = free.index(eos)
    model = _with_eos(target, eos)
    spec = SPECS[method](draft)
    short = generate(model, [PROMPTS[0]], SamplingParams(max_new_tokens=8), spec).outputs[0]
    assert short["token_ids"] == free[: stop_at + 1] and short["finish_reason"] == "eos"
    out = generate(model, [PROMPTS[0]], SamplingParams(max_new_tokens=8, min_tokens=6), spec).outputs[0]
    ref: list[int] = []
    while len(ref) < 8:
        logp = _reference_logprobs(model, PROMPTS[0], ref + [0])[-1]
        if len(ref) < 6:
            logp[eos] = -np.inf
        ref.append(int(np.argmax(logp)))
        if ref[-1] == eos:
            break
    assert out["token_ids"] == ref and eos not in out["token_ids"][:6]


def test_min_tokens_and_logprobs_are_validated(pair):
    target, _ = pair
    for kw, msg in [
        ({"min_tokens": 9}, "min-tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": -1}, "min-tokens"),
    ]:
        with pytest.raises(UserError, match=msg):
            generate(target, [PROMPTS[0]], SamplingParams(max_new_tokens=8, **kw))
