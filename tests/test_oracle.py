"""Offline greedy acceptance analysis: hand-computed traces, BLEU-4, and the engine as ground truth."""

import dataclasses
import math

import chex
import jax
import numpy as np
import pytest

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.analysis.oracle import (
    aggregate,
    analyze,
    bleu4,
    bleu_bin,
    combine,
    ngram_accept_lengths,
    oracle_lengths,
    render_markdown,
    run_lengths,
    simulate_rounds,
    teacher_forced_matches,
)

T, F = True, False


# --- pure functions on hand-made traces -----------------------------------------------------


def test_run_lengths_hand_trace():
    match = np.array([T, T, F, T, T, T, F, T])
    np.testing.assert_array_equal(run_lengths(match, 5), [2, 1, 0, 3, 2, 1, 0, 1])
    np.testing.assert_array_equal(run_lengths(match, 2), [2, 1, 0, 2, 2, 1, 0, 1])
    np.testing.assert_array_equal(run_lengths(np.ones(4, bool), 3), [3, 3, 2, 1])  # capped by the end
    assert run_lengths(np.zeros(0, bool), 3).shape == (0,)


def test_simulate_rounds_hand_trace_with_end_cap():
    # t=0: a=2 -> t=3; t=3: a=1 -> t=5; t=5: a=min(3, 8-5-1)=2 (end cap) -> t=8
    sim = simulate_rounds(np.array([2, 0, 0, 1, 0, 3, 0, 0]), k=3)
    assert sim["rounds"] == 3 and sim["tokens"] == 8
    assert sim["tokens_per_round"] == pytest.approx(8 / 3)
    assert sim["accepted_at"] == [3, 2, 0]
    np.testing.assert_allclose(sim["per_position_acceptance"], [1.0, 2 / 3, 0.0])


def test_simulate_rounds_nothing_accepted_is_autoregressive():
    sim = simulate_rounds(np.zeros(5, np.int64), k=4)
    assert sim["rounds"] == 5 and sim["tokens_per_round"] == 1.0
    assert sim["per_position_acceptance"] == [0.0] * 4


def test_oracle_lengths_and_rounds():
    np.testing.assert_array_equal(oracle_lengths(7, 3), [3, 3, 3, 3, 2, 1, 0])
    np.testing.assert_array_equal(oracle_lengths(1, 3), [0])
    sim = simulate_rounds(oracle_lengths(7, 3), 3)  # t=0: a=3 -> 4; t=4: a=2 -> 7
    assert sim["rounds"] == 2 and sim["tokens_per_round"] == 3.5
    assert sim["accepted_at"] == [2, 2, 1]
    # K + 1 tokens per round when the output is a whole number of rounds
    assert simulate_rounds(oracle_lengths(12, 3), 3)["tokens_per_round"] == 4.0


def test_combine_is_elementwise_max():
    np.testing.assert_array_equal(combine(np.array([2, 0, 1, 0]), np.array([0, 3, 0, 0])), [2, 3, 1, 0])
    with pytest.raises(ValueError):
        combine(np.zeros(3), np.zeros(4))


# --- BLEU-4 ---------------------------------------------------------------------------------


def test_bleu4_identical_and_disjoint():
    seq = [5, 9, 2, 7, 7, 3, 1]
    assert bleu4(seq, seq) == pytest.approx(1.0)
    assert bleu4([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == 0.0  # no shared unigram: unsmoothed p1 = 0
    assert bleu4([], [1, 2, 3]) == 0.0


def test_bleu4_hand_computed():
    # p1 = 4/5; add-one: p2 = (3+1)/(4+1), p3 = (2+1)/(3+1), p4 = (1+1)/(2+1); BP = exp(1 - 6/5)
    want = (4 / 5 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25 * math.exp(1 - 6 / 5)
    assert bleu4([1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7]) == pytest.approx(want, rel=1e-12)
    # clipping: [7]*4 vs [7]*2 -> p1 = 2/4, p2 = (1+1)/(3+1), p3 = (0+1)/(2+1), p4 = (0+1)/(1+1); no BP
    assert bleu4([7, 7, 7, 7], [7, 7]) == pytest.approx((1 / 2 * 1 / 2 * 1 / 3 * 1 / 2) ** 0.25, rel=1e-12)


def test_bleu4_brevity_penalty():
    ref = list(range(8))
    assert bleu4(ref[:4], ref) == pytest.approx(math.exp(1 - 8 / 4))  # all precisions 1
    assert bleu4(ref[:4], ref, brevity_penalty=False) == pytest.approx(
        1.0
    )  # the overlap measure analyze uses
    assert bleu4(ref, ref[:4]) < 1.0  # longer candidate: no BP, but precision drops
    assert bleu4(ref + ref[:4], ref) == pytest.approx(bleu4(ref + ref[:4], ref + [99]))  # c > r either way


def test_bleu_bin_labels():
    assert bleu_bin(0.0) == "0.0-0.1"
    assert bleu_bin(0.1) == "0.1-0.2"
    assert bleu_bin(0.15) == "0.1-0.2"
    assert bleu_bin(0.39) == "0.2-0.4"
    assert bleu_bin(0.4) == "0.4-1.0"
    assert bleu_bin(1.0) == "0.4-1.0"
    assert bleu_bin(0.3, edges=(0.0, 0.5, 1.0)) == "0.0-0.5"
    with pytest.raises(ValueError):
        bleu_bin(1.5)


# --- n-gram accepted lengths -----------------------------------------------------------------

# prompt 1 2 3 4 5, output 1 2 3 4 6: the lookup finds the prompt again from the 2nd output token on
TOKENS = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6]


def test_ngram_accept_lengths_hand_trace():
    # t=5: no earlier 5 -> 0; t=6: [1] -> proposes 2 3 4, all right; t=7: [1 2] -> 3 4 5 vs 3 4 6;
    # t=8: [1 2 3] -> 4 5 1 vs 4 6; t=9: [1 2 3 4] -> 5 1 2 vs 6
    np.testing.assert_array_equal(ngram_accept_lengths(TOKENS, 5, k=3), [0, 3, 2, 1, 0])
    np.testing.assert_array_equal(ngram_accept_lengths(TOKENS, 5, k=1), [0, 1, 1, 1, 0])
    np.testing.assert_array_equal(ngram_accept_lengths(TOKENS, 5, k=3, n_min=2), [0, 0, 2, 1, 0])


# --- one prompt, and pooled over prompts -------------------------------------------------------


def test_analyze_aggregate_render():
    # prompt 1: lengths ngram [0 3 2 1 0], draft runs [1 0 3 2 1], combine [1 3 3 2 1], oracle [3 3 2 1 0]
    r1 = analyze(TOKENS[:5], TOKENS[5:], np.array([T, F, T, T, T]), k=3)
    assert r1["bleu4"] == pytest.approx((4 / 5 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25)
    assert r1["bleu_bin"] == "0.4-1.0"
    assert {m: s["rounds"] for m, s in r1["methods"].items()} == {
        "ngram": 2,
        "draft": 2,
        "oracle": 2,
        "combine": 2,
    }
    assert r1["methods"]["ngram"]["accepted_at"] == [1, 1, 1]  # rounds accept 0 and 3
    assert r1["methods"]["draft"]["accepted_at"] == [2, 1, 0]  # rounds accept 1 and 2
    # prompt 2: nothing repeats and the draft is always wrong -> AR for both; the oracle takes 1 round
    r2 = analyze([10, 11, 12], [20, 21, 22, 23], np.zeros(4, bool), k=3)
    assert r2["bleu4"] == 0.0 and r2["bleu_bin"] == "0.0-0.1"
    assert r2["methods"]["ngram"]["rounds"] == 4 and r2["methods"]["oracle"]["rounds"] == 1
    with pytest.raises(ValueError):
        analyze([1, 2], [3, 4], np.zeros(3, bool), k=2)

    agg = aggregate([r1, r2])
    assert agg["n_prompts"] == 2
    assert agg["methods"]["ngram"]["tokens_per_round"] == pytest.approx(9 / 6)  # pooled, not a mean of ratios
    assert agg["methods"]["oracle"]["tokens_per_round"] == pytest.approx(9 / 3)
    np.testing.assert_allclose(agg["methods"]["draft"]["per_position_acceptance"], [2 / 6, 1 / 6, 0.0])
    assert [b["n_prompts"] for b in agg["bins"].values()] == [1, 0, 0, 1]
    assert agg["bins"]["0.4-1.0"]["methods"]["draft"]["tokens_per_round"] == pytest.approx(2.5)
    assert agg["bins"]["0.0-0.1"]["methods"]["draft"]["tokens_per_round"] == pytest.approx(1.0)

    md = render_markdown(agg)
    assert "| n-gram | 1.50 | 6 | 9 | 0.17, 0.17, 0.17 |" in md
    assert "| oracle | 3.00 | 3 | 9 |" in md
    assert "| 0.1-0.2 | 0 | - | - | - |" in md
    assert "| 0.4-1.0 | 1 | 2.50 | 2.50 | 2.50 |" in md
    assert "| 0.0-0.1 | 1 | 1.00 | 1.00 | 1.00 |" in md


# --- teacher-forced matches on tiny models, against the engine ---------------------------------


@pytest.fixture(scope="module")
def traces(ar_ref):
    """(prompt, output) pairs of the greedy AR output of the target of ``pair`` (20 tokens each)."""
    from test_sd import PROMPTS

    return [(list(p), list(o)) for p, o in zip(PROMPTS, ar_ref)]


@pytest.fixture(scope="module")
def noisy_draft(pair):
    """The target with 5% weight noise: same config (so compiled steps are shared), agrees often but not always.

    (``pair``'s own draft is an unrelated random model that never agrees with the target.)
    """
    target, _ = pair
    leaves, tree = jax.tree.flatten(target.params)
    rng = np.random.default_rng(0)
    noisy = [x + 0.05 * np.std(np.asarray(x)) * rng.standard_normal(x.shape).astype(x.dtype) for x in leaves]
    return dataclasses.replace(target, name="noisy-target", params=jax.tree.unflatten(tree, noisy))


def test_target_matches_its_own_greedy_output(pair, traces):
    target, _ = pair
    for prompt, out in traces:
        m = teacher_forced_matches(target, prompt + out, len(prompt))
        chex.assert_shape(m, (len(out),))
        assert m.dtype == bool and m.all()


def test_draft_matches_equal_one_step_generation(noisy_draft, traces):
    """match[i] against the draft's own one-token greedy generation (prefill + KV cache) from the true prefix.

    Prefixes of at most 16 tokens, 4 at a time: the shapes ``ar_ref`` already compiled for this config.
    """
    got, truth = [], []
    for p, o in traces:
        got.append(teacher_forced_matches(noisy_draft, p + o, len(p))[: 16 - len(p) + 1])
        truth += [o[i] for i in range(16 - len(p) + 1)]
    prefixes = [p + o[:i] for p, o in traces for i in range(16 - len(p) + 1)]
    nxt = []
    for j in range(0, len(prefixes), 4):
        batch = prefixes[j : j + 4]
        batch += [batch[0]] * (4 - len(batch))
        res = generate(noisy_draft, batch, SamplingParams(max_new_tokens=1, ignore_eos=True))
        nxt += [r["token_ids"][0] for r in res.outputs]
    want = np.array(nxt[: len(truth)]) == np.array(truth)
    got = np.concatenate(got)
    assert 0 < want.sum() < len(want)  # mixed, so an off-by-one or a constant answer fails
    np.testing.assert_array_equal(got, want)


def test_ngram_rounds_equal_engine_verify_steps(pair, traces):
    """Offline n-gram rounds (after the prefill token) equal the SD engine's per-request verify steps."""
    target, _ = pair
    k = 3
    res = generate(
        target,
        [p for p, _ in traces],
        SamplingParams(max_new_tokens=20, ignore_eos=True),
        SpecConfig(method="sd", draft="ngram", k=k),
    )
    steps = []
    for (prompt, out), o in zip(traces, res.outputs):
        assert o["token_ids"] == out
        lengths = ngram_accept_lengths(prompt + out, len(prompt), k)
        steps.append(o["metrics"]["verify_steps"])
        assert simulate_rounds(lengths[1:], k)["rounds"] == steps[-1]
    assert min(steps) < 19  # some prompt accepted n-gram proposals (19 rounds = nothing accepted)
