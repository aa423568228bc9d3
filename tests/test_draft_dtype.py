"""A draft stored in bfloat16 under a float32 target (``--draft-dtype``, ``SpecConfig.draft_dtype``):
which tensors are cast, greedy equality with AR through SD and SSD, the flag's plumbing and bad input.

The statistical exactness of SD with a bfloat16 draft is in ``test_exactness.py``
(``test_bf16_draft_emissions_follow_the_target``); the kernel's bfloat16 path in ``test_kernels.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from reference import noisy_copy
from test_sd import PROMPTS

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.bench import protocol
from ssd_jax.drafters import vocab as dv
from ssd_jax.errors import UserError
from ssd_jax.loading.loaded import with_weight_dtype
from ssd_jax.models import kernels

needs_kernel = pytest.mark.skipif(
    not kernels.available(), reason="no CPU kernel (the bfloat16 draft would widen)"
)


@pytest.fixture(scope="module")
def close_pair(pair):
    """The tiny target and a noisy copy of it: a draft that is accepted often, so the bfloat16 draft's
    proposals really decide rounds."""
    return pair[0], noisy_copy(pair[0], 0.005, seed=5)  # greedy acceptance 0.63 (float32 and bfloat16)


def test_only_the_matrices_are_cast_and_the_cast_is_cached(close_pair):
    _, draft = close_pair
    bf = with_weight_dtype(draft, "bfloat16")
    assert bf.cfg.weight_dtype == "bfloat16" and bf.cfg.dtype == "float32"
    assert draft.cfg.weight_dtype is None  # stored in its compute dtype
    layer = bf.params["layers"][0]
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert layer[name].dtype == jnp.bfloat16, name
    assert layer["attn_norm"].dtype == jnp.float32 and bf.params["final_norm"].dtype == jnp.float32
    head = "embed" if draft.cfg.tie_embeddings else "lm_head"
    assert bf.params[head].dtype == jnp.bfloat16
    assert draft.params["layers"][0]["wq"].dtype == jnp.float32  # the original is left as it was
    assert with_weight_dtype(draft, "bfloat16") is bf  # cast once per model
    assert with_weight_dtype(draft, "float32") is draft  # already stored in its compute dtype
    back = with_weight_dtype(bf, "float32")
    assert back.cfg.weight_dtype is None and back.params["layers"][0]["wq"].dtype == jnp.float32


@needs_kernel
@pytest.mark.parametrize(
    "spec",
    [dict(method="sd"), dict(method="sd", trim=True), dict(method="ssd", backup="neural")],
    ids=["sd", "sd-trimmed", "ssd-neural"],
)
def test_greedy_with_bf16_draft_equals_greedy_ar(close_pair, ar_ref, spec):
    target, draft = close_pair
    if spec.pop("trim", False):  # a trimmed head (kept: the tokens AR emits, and a few more) is cast too
        draft = dv.trim_draft(
            draft, np.union1d(np.concatenate(ar_ref), np.arange(0, 128, 8)).astype(np.int32)
        )
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    res = generate(target, PROMPTS, sp, SpecConfig(draft=draft, k=3, draft_dtype="bfloat16", **spec))
    assert [o["token_ids"] for o in res.outputs] == ar_ref
    assert res.metrics["draft_dtype"] == "bfloat16"
    if "head_ids" in draft.params:
        assert with_weight_dtype(draft, "bfloat16").params["head"].dtype == jnp.bfloat16
    assert res.metrics["acceptance_rate"] > 0.3  # the bfloat16 draft proposed, and was accepted


def test_bad_draft_dtype_is_refused():
    with pytest.raises(UserError, match="unknown draft dtype"):
        SpecConfig(method="sd", draft="x", draft_dtype="float16").validate()
    with pytest.raises(UserError, match="method ar has no draft"):
        SpecConfig(method="ar", draft_dtype="bfloat16").validate()
    with pytest.raises(UserError, match="the ngram drafter has none"):
        SpecConfig(method="sd", draft="ngram", draft_dtype="bfloat16").validate()
    SpecConfig(method="ssd", draft="x", draft_dtype="bfloat16").validate()


def test_protocol_methods_take_bf16():
    specs = protocol.method_specs(
        ["ar", "sd:auto:v64:bf16", "sd:2:bf16", "ssd:4:bf16", "sd:2", "sd:auto:full:f32"], draft="d"
    )
    assert (
        specs["sd-kauto-v64-bf16"].draft_dtype == "bfloat16" and specs["sd-kauto-v64-bf16"].draft_vocab == 64
    )
    # an option not given stays "auto" (what a user without flags gets)
    assert specs["sd-k2-bf16"].draft_dtype == "bfloat16" and specs["sd-k2-bf16"].draft_vocab == "auto"
    assert specs["ssd-k4-bf16"].draft_dtype == "bfloat16"
    assert specs["sd-k2"].draft_dtype == "auto" and specs["sd-k2"].draft_vocab == "auto"
    full = specs["sd-kauto-vfull-f32"]
    assert full.draft_dtype == "float32" and full.draft_vocab is None
    for bad in ("ngram:2:bf16", "sd:2:bf16:bf16", "sd:2:v64:x", "sd:2:full:v64", "ngram:2:full"):
        with pytest.raises(UserError, match="bad method"):
            protocol.method_specs(["ar", bad], draft="d")
