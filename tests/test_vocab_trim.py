"""Draft vocabulary trimming (``ssd_jax.drafters.vocab``): the trimmed head, the kept set, the
token-count file, greedy equality with AR, and bad input.

The statistical exactness of SD and SSD with a trimmed draft is in ``test_exactness.py``
(``test_trimmed_draft_emissions_follow_the_target`` and its negative control).
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax.numpy as jnp
import numpy as np
import pytest
from reference import noisy_copy
from test_sd import PROMPTS, tiny_model

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.drafters import vocab as dv
from ssd_jax.errors import UserError
from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.models import llama

V = 128
KEEP = 64  # half the vocabulary


@pytest.mark.parametrize("tied", [True, False])
def test_trimmed_head_is_the_full_head_on_kept_ids_and_minus_inf_elsewhere(tied):
    m = tiny_model(3, tie_embeddings=tied)
    ids = np.sort(np.random.default_rng(0).choice(V, KEEP, replace=False)).astype(np.int32)
    t = dv.trim_draft(m, ids)
    assert t.params["head"].shape == (KEEP, m.cfg.hidden_size)
    assert "lm_head" not in t.params  # the full untied head is not kept next to the slice
    assert t.params["embed"].shape == (V, m.cfg.hidden_size)  # input lookup still covers every id
    h = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, m.cfg.hidden_size)), jnp.float32)
    full, trimmed = np.asarray(llama.logits(m.params, m.cfg, h)), np.asarray(llama.logits(t.params, t.cfg, h))
    assert trimmed.shape == full.shape
    np.testing.assert_allclose(trimmed[..., ids], full[..., ids], rtol=1e-6, atol=1e-6)
    out = np.setdiff1d(np.arange(V), ids)
    assert np.all(np.isneginf(trimmed[..., out]))
    if tied:  # re-cut from the whole embedding (a draft trained trimmed, given another --draft-vocab)
        t2 = dv.trim_draft(t, ids[: KEEP // 2])
        assert t2.params["head"].shape == (KEEP // 2, m.cfg.hidden_size)
        assert "head" not in dv.full_head(t).params and dv.head_vocab(t) == KEEP and dv.head_vocab(m) is None
    else:  # the untied head's other rows were dropped
        with pytest.raises(UserError, match="already"):
            dv.trim_draft(t, ids)


def test_kept_ids_are_deterministic_with_ties_to_the_smaller_id_and_keep_specials():
    counts = np.array([5, 0, 9, 5, 5, 1, 9, 0], np.int64)
    assert dv.kept_ids(counts, 3).tolist() == [0, 2, 6]  # 9, 9, then the first of the three 5s
    assert dv.kept_ids(counts, 4, always=[7]).tolist() == [0, 2, 6, 7]  # a never-seen special kept
    assert dv.kept_ids(counts, 8).tolist() == list(range(8))
    assert dv.kept_ids(counts, 1).dtype == np.int32
    for n in (0, 9):
        with pytest.raises(UserError, match="between 1 and"):
            dv.kept_ids(counts, n)
    with pytest.raises(UserError, match="special tokens"):
        dv.kept_ids(counts, 1, always=[1, 7])


# --------------------------------------------------------------------------- greedy equality


@pytest.fixture(scope="module")
def trim_pair(pair, ar_ref):
    """The tiny target, a noisy copy of it as the draft, and counts from the target's own tokens on
    the first two prompts (so the other two rows also need tokens outside the kept set)."""
    target = pair[0]
    draft = noisy_copy(target, 0.02, seed=3)
    counts = np.bincount(np.concatenate([np.asarray(t) for t in ar_ref[:2]]), minlength=V)[:V]
    return target, draft, counts


def _sp():
    return SamplingParams(max_new_tokens=20, ignore_eos=True)


@pytest.mark.parametrize(
    "spec",
    [dict(method="sd"), dict(method="ssd", backup="neural"), dict(method="ssd", backup="ngram")],
    ids=["sd", "ssd-neural", "ssd-ngram"],
)
def test_greedy_with_trimmed_draft_equals_greedy_ar(trim_pair, ar_ref, spec):
    target, draft, counts = trim_pair
    ids = dv.kept_ids(counts, KEEP)
    outside = 1 - np.isin(np.concatenate(ar_ref), ids).mean()
    assert outside > 0.15, outside  # AR tokens outside the kept set: the draft cannot propose them
    res = generate(target, PROMPTS, _sp(), SpecConfig(draft=dv.trim_draft(draft, ids), k=3, **spec))
    assert [o["token_ids"] for o in res.outputs] == ar_ref
    assert res.metrics["acceptance_rate"] > 0.05  # the trimmed draft really proposed (and was accepted)


def test_spec_draft_vocab_trims_through_generate(trim_pair, ar_ref, monkeypatch):
    target, draft, counts = trim_pair
    with pytest.raises(UserError, match="no tokenizer"):  # tiny models have none: nothing to count with
        generate(target, PROMPTS, _sp(), SpecConfig(method="sd", draft=draft, k=3, draft_vocab=KEEP))
    seen = []
    monkeypatch.setattr(dv, "draft_token_counts", lambda model, source=None: seen.append(source) or counts)
    for method in ("sd", "ssd"):
        res = generate(target, PROMPTS, _sp(), SpecConfig(method=method, draft=draft, k=3, draft_vocab=KEEP))
        assert [o["token_ids"] for o in res.outputs] == ar_ref
        assert res.metrics["draft_vocab"] == KEEP
    assert seen == [draft]  # counted and cut once: the loaded draft's trimmed copy is reused
    assert dv.trimmed_draft(draft, KEEP, None) is dv.trimmed_draft(draft, KEEP, None)
    with pytest.raises(UserError, match="vocabulary of 128"):
        generate(target, PROMPTS, _sp(), SpecConfig(method="sd", draft=draft, k=3, draft_vocab=V + 1))
    assert dv.trimmed_draft(draft, V, None) is draft  # all kept: nothing to trim
    untrimmed = generate(target, PROMPTS, _sp(), SpecConfig(method="sd", draft=draft, k=3))
    assert "draft_vocab" not in untrimmed.metrics


# --------------------------------------------------------------------------- the counts file


def _word_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    words = ["<eos>", "<unk>", "a", "b", "c", "d", "e", "f"]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    return Tokenizer(tok, eos_token_ids=(0,))


TEXTS = ["a b a c", "c c d", "a", "f e d c b a a"] * 300


@pytest.fixture
def word_model(monkeypatch, tmp_path):
    monkeypatch.setenv("SSD_JAX_CACHE", str(tmp_path / "cache"))
    m = tiny_model(4, vocab=10)
    return dataclasses.replace(m, tokenizer=_word_tokenizer())


def test_counts_match_one_by_one_encoding(word_model):
    tok = word_model.tokenizer
    want = np.zeros(10, np.int64)
    for t in TEXTS:
        for i in tok.encode(t):
            want[i] += 1
    got = dv.count_tokens(tok, TEXTS, 10)
    np.testing.assert_array_equal(got, want)
    assert got[2] == 1500 and got[8:].sum() == 0  # "a"; ids past the tokenizer's 8 never occur


def test_counts_file_is_written_once_atomically_and_reloaded(word_model, tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return TEXTS

    a = dv.draft_token_counts(word_model, None, texts)
    files = list((tmp_path / "cache" / "vocab").iterdir())
    assert len(files) == 1 and files[0].name.endswith(f"{dv.CORPUS_TAG}.npz")  # no temporary file left
    first = files[0].read_bytes()
    b = dv.draft_token_counts(word_model, None, texts)  # from the file: not counted again
    assert calls == [1]
    np.testing.assert_array_equal(a, b)
    files[0].unlink()
    time.sleep(2.1)  # zip timestamps have 2 s resolution: the bytes must not depend on the clock
    dv.draft_token_counts(word_model, None, texts)
    assert files[0].read_bytes() == first  # deterministic: the same bytes when recomputed
    files[0].write_bytes(b"not an npz")  # damaged: recounted and rewritten
    np.testing.assert_array_equal(dv.draft_token_counts(word_model, None, texts), a)
    assert len(calls) == 3 and files[0].read_bytes() == first
    # kept set: EOS (a special token, never counted) always; then a (1500), c (1200), ...
    ids = dv.kept_ids(a, 3, dv.always_kept(word_model.tokenizer))
    assert ids.tolist() == [0, 2, 4]


def test_counts_file_from_another_tokenizer_or_vocabulary_is_not_used(word_model, tmp_path):
    path = tmp_path / "c.npz"
    counts = np.arange(10)
    dv.write_counts(path, counts, dv._meta(word_model.tokenizer, 10))
    np.testing.assert_array_equal(dv.read_counts(path, word_model.tokenizer, 10), counts)
    assert dv.read_counts(path, word_model.tokenizer, 11) is None
    assert dv.read_counts(path, None, 10) is None
    assert dv.read_counts(tmp_path / "missing.npz", word_model.tokenizer, 10) is None


def test_counts_of_a_trained_draft_live_next_to_it(word_model, tmp_path):
    d = tmp_path / "my-draft"
    d.mkdir()
    (d / "draft.json").write_text("{}")
    dv.draft_token_counts(word_model, str(d), lambda: TEXTS)
    assert (d / dv.COUNTS_FILE).is_file()
    assert not (tmp_path / "cache" / "vocab").exists()
    if os.geteuid() != 0:  # root can write anywhere
        os.chmod(d, 0o555)
        try:
            dv.draft_token_counts(word_model, str(d), lambda: TEXTS)
            assert (tmp_path / "cache" / "vocab").is_dir()  # not writable: the cache instead
        finally:
            os.chmod(d, 0o755)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--method", "sd", "--draft", "x", "--draft-vocab", "0"], "positive integer"),
        (["--method", "sd", "--draft", "x", "--draft-vocab", "-5"], "positive integer"),
        (["--method", "sd", "--draft", "x", "--draft-vocab", "many"], "draft-vocab"),
        (["--draft-vocab", "100"], "method ar has no draft"),
        (["--method", "sd", "--draft", "ngram", "--draft-vocab", "100"], "ngram drafter has none"),
        (["--method", "sd", "--draft", "random", "--draft-vocab", "100"], "random drafter has none"),
    ],
)
def test_bad_draft_vocab_flags(args, needle, capsys):
    """One line on stderr, nothing on stdout, exit status 2, before any model is loaded."""
    from ssd_jax.cli.decode import main

    try:
        rc = main([*args, "--target", "no-such-model-would-be-loaded", "--prompt", "hi"])
    except SystemExit as e:  # argparse's own type errors (same one-line convention)
        rc = e.code
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and out == "" and len(lines) == 1, (rc, out, err)
    assert needle.lower() in lines[0].lower(), lines[0]


def test_draft_vocab_larger_than_the_vocabulary_from_the_cli(tiny_llama_path, capsys):
    from ssd_jax.cli.decode import main

    rc = main(
        [
            "--target",
            tiny_llama_path,
            "--method",
            "sd",
            "--draft",
            tiny_llama_path,
            "--draft-vocab",
            "129",
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "2",
        ]
    )
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and out == "" and len(lines) == 1, (rc, out, err)
    assert "vocabulary of 128 tokens, got 129" in lines[0]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "64"])
def test_spec_config_refuses_bad_draft_vocab(bad):
    with pytest.raises(UserError, match="positive integer"):
        SpecConfig(method="sd", draft="x", draft_vocab=bad).validate()
    SpecConfig(method="sd", draft="x", draft_vocab=np.int64(3)).validate()


def test_a_draft_trained_trimmed_loads_with_its_head(tmp_path):
    """draft.json's training arguments name the head a draft was trained with; loading cuts it then."""
    import json

    from ssd_jax.loading.draft import trained_head_vocab

    d = tmp_path / "draft"
    (d / "best" / "params").mkdir(parents=True)
    (d / "draft.json").write_text(json.dumps({"train": {"args": {"draft_vocab": 64}}}))
    assert trained_head_vocab(d / "state" / "7") == (64, d)  # a training step of the run
    assert trained_head_vocab(tmp_path / "elsewhere" / "params") is None
    (d / "best" / "draft.json").write_text(json.dumps({"train": {"args": {"draft_vocab": 32}}}))
    assert trained_head_vocab(d / "best" / "params") == (32, d / "best")  # the nearest draft.json
    assert trained_head_vocab(d) == (64, d)
    (d / "best" / "draft.json").write_text(json.dumps({"train": {"args": {}}}))
    assert trained_head_vocab(d / "best" / "params") is None  # trained with the full head
