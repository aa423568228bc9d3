"""``draft_dtype="auto"`` / ``draft_vocab="auto"`` (the defaults): which draft variants are worth a
measurement, that the one with the largest calibrated speedup is chosen, that the choice is cached
and follows the stored numbers, that greedy output still equals AR, and the CLI's spelling
(tiny random models; the real Qwen pair is measured by the benchmark protocol)."""

import dataclasses
import json

import pytest
from test_sd import PROMPTS, _ids

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.cli.args import Parser, add_spec_args, spec_from_args
from ssd_jax.planning import configure, variants
from ssd_jax.models import kernels

SP = SamplingParams(max_new_tokens=20, ignore_eos=True)


def test_variants_worth_measuring(pair, monkeypatch):
    target, draft = pair
    spec = SpecConfig(method="sd", draft=draft)
    # a draft whose weights stay in the caches, with a small vocabulary: nothing to choose
    assert variants.draft_variants(target, spec, draft) == [(None, None)]
    monkeypatch.setattr(variants, "BF16_MIN_BYTES", 0)
    monkeypatch.setattr(variants, "TRIM_TRY", 32)  # the tiny draft's 128 tokens count as a large vocabulary
    bf16 = ["bfloat16"] if kernels.available() else []
    want = [(d, v) for d in [None, *bf16] for v in (None, 32)]
    assert variants.draft_variants(target, spec, draft) == want
    # a value given stays as given; only the "auto" field is chosen
    assert variants.draft_variants(target, dataclasses.replace(spec, draft_dtype="float32"), draft) == [
        ("float32", None),
        ("float32", 32),
    ]
    assert variants.draft_variants(target, dataclasses.replace(spec, draft_vocab=None), draft) == [
        (d, None) for d in [None, *bf16]
    ]
    assert variants.draft_variants(
        target, dataclasses.replace(spec, draft_dtype="bfloat16", draft_vocab=64), draft
    ) == [("bfloat16", 64)]
    monkeypatch.setattr(variants, "TRIM_TRY", 64)  # 128 is not more than 2 x 64: no trimmed head tried
    assert all(v is None for _, v in variants.draft_variants(target, spec, draft))


def test_ar_and_drafters_without_weights_resolve_to_nothing(pair):
    target, _ = pair
    for spec in (SpecConfig(), SpecConfig(method="sd", draft="ngram", k=2)):
        got, plan = configure(target, spec, rows=1, load=None)
        assert (got.draft_dtype, got.draft_vocab, plan.draft_auto, plan.calibration_s) == (
            None,
            None,
            None,
            0.0,
        )


@pytest.mark.skipif(not kernels.available(), reason="bfloat16 drafts are offered only where the kernels run")
def test_the_fastest_variant_is_chosen_cached_and_exact(pair, ar_ref, tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_JAX_KAUTO_CACHE", str(tmp_path))
    monkeypatch.setattr(variants, "BF16_MIN_BYTES", 0)
    target, draft = pair
    spec = SpecConfig(method="sd", draft=draft)
    res = generate(target, PROMPTS, SP, spec)
    info = res.metrics["draft_auto"]
    rows = info["variants"]
    assert [(r["draft_dtype"], r["draft_vocab"]) for r in rows] == [(None, None), ("bfloat16", None)]
    best = max(rows, key=lambda r: r["expected_speedup"])
    assert info["chosen"] == {"draft_dtype": best["draft_dtype"], "draft_vocab": None}
    assert res.metrics.get("draft_dtype") == best["draft_dtype"]
    assert info["calibration_s"] > 0 and _ids(res) == ar_ref  # every variant is exact
    # one record per variant, each with the same target side (measured once for both)
    recs = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert sorted(str(r["draft"]["weight_dtype"]) for r in recs) == ["None", "bfloat16"]
    assert recs[0]["costs"]["t_ar"] == recs[1]["costs"]["t_ar"]
    again = generate(target, PROMPTS, SP, spec)
    assert again.metrics["draft_auto"]["calibration_s"] == 0.0
    assert again.metrics["draft_auto"]["chosen"] == info["chosen"]
    # the choice follows the stored numbers: whichever variant's draft step is made cheap wins
    for fast in ("bfloat16", None):
        for p in tmp_path.glob("*.json"):
            r = json.loads(p.read_text())
            r["costs"]["t_draft_step"] = 0.0 if r["draft"]["weight_dtype"] == fast else 10.0
            p.write_text(json.dumps(r))
        out = generate(target, PROMPTS, SP, spec)
        assert out.metrics["draft_auto"]["chosen"]["draft_dtype"] == fast
        assert out.metrics.get("draft_dtype") == fast and _ids(out) == ar_ref


def test_cli_spelling():
    p = Parser(prog="t")
    add_spec_args(p)
    spec = spec_from_args(p.parse_args(["--method", "sd", "--draft", "x"]))
    assert (spec.draft_dtype, spec.draft_vocab) == ("auto", "auto")
    spec = spec_from_args(
        p.parse_args(["--method", "sd", "--draft", "x", "--draft-vocab", "full", "--draft-dtype", "float32"])
    )
    assert (spec.draft_dtype, spec.draft_vocab) == ("float32", None)
    assert spec_from_args(p.parse_args(["--draft-vocab", "4096"])).draft_vocab == 4096
    with pytest.raises(SystemExit):
        p.parse_args(["--draft-vocab", "lots"])
