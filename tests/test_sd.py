"""Speculative decoding: greedy equality with AR, statistical exactness, metrics and bad input."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.compile import fresh_programs
from ssd_jax.decoding import sd as sd_mod
from ssd_jax.errors import UserError
from ssd_jax.loading import LoadedModel
from ssd_jax.models import llama
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import init_params
from ssd_jax.sampling.filters import RowSampling, filter_logprobs

PROMPTS = [[3, 17, 29, 3, 17], [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7], [77], [90, 91, 92, 93, 94, 90, 91]]


def tiny_model(seed, vocab=128, name=None, layers=2, scale=0.15, **kw):
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_ids=(1,),
        **kw,
    )
    return LoadedModel(
        name or f"tiny-{seed}", cfg, init_params(cfg, seed, scale=scale), None, f"seed{seed}", ""
    )


def _ids(res):
    return [o["token_ids"] for o in res.outputs]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("drafter", ["model", "ngram", "random"])
def test_greedy_sd_equals_greedy_ar(pair, ar_ref, k, drafter):
    target, draft = pair
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ar = ar_ref
    res = generate(
        target, PROMPTS, sp, SpecConfig(method="sd", draft=draft if drafter == "model" else drafter, k=k)
    )
    assert _ids(res) == ar
    check_round_accounting(res, k, fixed_k=drafter != "ngram")
    assert len(res.metrics["per_position_acceptance"]) == k


def check_round_accounting(res, k, fixed_k=True):
    """The run's metrics agree with its per-row round traces, and the traces with the emitted tokens."""
    m = res.metrics
    traces = [o["metrics"]["accepted_per_round"] for o in res.outputs]
    for o, tr in zip(res.outputs, traces):
        n_tok = len(o["token_ids"])
        emitted = np.cumsum([a + 1 for a in tr])
        # the prefill gives the first token; every round emits accepted + 1; only the last may be cut short
        assert len(tr) >= 1 and emitted[-1] >= n_tok - 1 and (len(tr) == 1 or emitted[-2] < n_tok - 1), (
            tr,
            n_tok,
        )
        assert all(0 <= a <= k for a in tr)
        assert o["metrics"]["verify_steps"] == len(tr)
    assert m["verify_steps"] == max(len(t) for t in traces)
    flat = np.concatenate(traces)
    assert m["acceptance_histogram"] == np.bincount(flat, minlength=k + 1).tolist()
    assert m["mean_acceptance_length"] == pytest.approx((flat.sum() + len(flat)) / len(flat))
    if fixed_k:  # every round drafted k proposals
        assert m["acceptance_rate"] == pytest.approx(flat.sum() / (k * len(flat)))


def test_self_draft_accepts_everything(pair):
    """Drafting with the target itself must accept every greedy proposal (checks the draft cache logic)."""
    target, _ = pair
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    m = generate(target, PROMPTS, sp, SpecConfig(method="sd", draft=target, k=3)).metrics
    assert m["acceptance_rate"] == 1.0
    assert m["mean_acceptance_length"] == 4.0


def test_ragged_acceptance_and_eos(pair, ar_ref):
    """Rows stop at different rounds (EOS, length); output equals AR row by row."""
    target, draft = pair
    free = ar_ref
    eos = free[1][6]
    t2 = dataclasses.replace(target, cfg=target.cfg.replace(eos_token_ids=(eos,)))
    sp = SamplingParams(max_new_tokens=20)
    ar = _ids(generate(t2, PROMPTS, sp))
    sd = _ids(generate(t2, PROMPTS, sp, SpecConfig(method="sd", draft=draft, k=4)))
    assert sd == ar
    assert len(sd[1]) <= 7


def test_metrics_contract(pair):
    target, draft = pair
    res = generate(
        target,
        PROMPTS[:2],
        SamplingParams(max_new_tokens=8, ignore_eos=True),
        SpecConfig(method="sd", draft=draft, k=3, profile_stages=True),
    )
    m = res.metrics
    for key in (
        "acceptance_rate",
        "mean_acceptance_length",
        "per_position_acceptance",
        "acceptance_histogram",
        "verify_steps",
        "draft_s",
        "verify_s",
        "sample_s",
        "overhead_s",
    ):
        assert key in m
    # the stages are disjoint parts of the decode time
    stages = m["draft_s"] + m["verify_s"] + m["sample_s"]
    assert min(m["draft_s"], m["verify_s"], m["sample_s"]) > 0
    assert stages + m["overhead_s"] == pytest.approx(m["wall_s"] - m["ttft_s"], rel=1e-6)
    check_round_accounting(res, 3)
    for o in res.outputs:
        assert {"acceptance_rate", "mean_acceptance_length", "verify_steps"} <= set(o["metrics"])


@pytest.mark.parametrize("drafter", ["model", "ngram", "random"])
def test_one_call_rounds_equal_profiled_rounds(small_pair, drafter):
    """The default one-call-per-round loop draws exactly what the profiled three-call loop draws
    (same seed, T = 1, top-k), and makes one compiled call per round."""
    from ssd_jax.decoding import runtime

    target, draft = small_pair
    sp = SamplingParams(temperature=1.0, top_k=6, seed=8, max_new_tokens=20, ignore_eos=True, n=3)
    spec = SpecConfig(method="sd", draft=draft if drafter == "model" else drafter, k=3, prompt_lookup_min=1)
    prompts = [[2, 5, 2, 5, 2], [3, 7, 1]]
    prof = generate(target, prompts, sp, dataclasses.replace(spec, profile_stages=True))
    calls = {}
    real = runtime.Compiled.__call__

    def counted(self, *a):
        calls[self.name] = calls.get(self.name, 0) + 1
        return real(self, *a)

    runtime.Compiled.__call__ = counted
    try:
        fused = generate(target, prompts, sp, spec)
    finally:
        runtime.Compiled.__call__ = real
    assert _ids(fused) == _ids(prof)
    assert [o["metrics"]["accepted_per_round"] for o in fused.outputs] == [
        o["metrics"]["accepted_per_round"] for o in prof.outputs
    ]
    assert fused.metrics["draft_s"] is None and prof.metrics["draft_s"] > 0
    rounds = fused.metrics["verify_steps"]
    # one call per round (plus at most one round queued past the end), beside the prefills
    assert calls.pop("sd_round") in (rounds, rounds + 1), calls
    assert set(calls) <= {"prefill", "draft_prefill"}, calls


def test_vocab_padding_is_aligned():
    """A draft whose embedding table is padded larger than the target's still works exactly."""
    target = tiny_model(0)
    draft = tiny_model(1, vocab=160)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    assert _ids(generate(target, PROMPTS, sp, SpecConfig(method="sd", draft=draft, k=3))) == _ids(
        generate(target, PROMPTS, sp)
    )


def test_bad_spec(pair):
    target, draft = pair
    with pytest.raises(UserError, match="k must be"):
        generate(target, PROMPTS, SamplingParams(), SpecConfig(method="sd", draft="ngram", k=0))
    with pytest.raises(UserError, match="context window"):
        generate(
            target, PROMPTS, SamplingParams(max_new_tokens=500), SpecConfig(method="sd", draft=draft, k=16)
        )
    with pytest.raises(UserError, match="needs a draft"):
        generate(target, PROMPTS, SamplingParams(), SpecConfig(method="sd", k=2))


def test_mismatched_tokenizers_are_refused(pair):
    from ssd_jax.drafters.base import check_same_tokenizer

    class Tok:
        def __init__(self, fp):
            self.fp = fp

        def fingerprint(self):
            return self.fp

    t = dataclasses.replace(pair[0], tokenizer=Tok("a"))
    d = dataclasses.replace(pair[1], tokenizer=Tok("b"))
    with pytest.raises(UserError, match="different tokenizers"):
        check_same_tokenizer(t, d)
    check_same_tokenizer(t, dataclasses.replace(d, tokenizer=Tok("a")))


# --- statistical exactness ------------------------------------------------------------------

V_SMALL = 16
N_SAMPLES = 20_000


def chi2_threshold(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 4.75 is a one-sided p of about 1e-6."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, int]:
    """Pearson chi-square with cells of expected count < 5 pooled into one."""
    exp = probs * n
    big = exp >= 5
    obs_c = np.append(counts[big], counts[~big].sum())
    exp_c = np.append(exp[big], exp[~big].sum())
    keep = exp_c > 0
    stat = float((((obs_c - exp_c) ** 2)[keep] / exp_c[keep]).sum())
    return stat, int(keep.sum()) - 1


def exact_pair_distribution(target, prompt, rs_one, needs_filter):
    """P(t2, t3) of the 2nd and 3rd generated tokens, summing over the 1st, by enumeration."""
    cfg = target.cfg
    fwd = jax.jit(
        lambda ids: llama.logits(
            target.params,
            cfg,
            llama.forward(target.params, cfg, ids, llama.init_cache(cfg, ids.shape[0], 32))[0],
        )
    )

    def dist(ctx_batch):
        lg = fwd(jnp.asarray(ctx_batch, jnp.int32))[:, -1]
        rs = RowSampling(
            *(jnp.broadcast_to(x, (lg.shape[0],)) for x in (rs_one.temperature, rs_one.top_k, rs_one.top_p))
        )
        return np.exp(np.asarray(filter_logprobs(lg, rs, needs_filter), np.float64))

    V = cfg.vocab_size
    p1 = dist([prompt])[0]
    p2 = dist([prompt + [a] for a in range(V)])  # (V, V): row = t1
    ctx3 = [prompt + [a, b] for a in range(V) for b in range(V)]
    p3 = dist(ctx3).reshape(V, V, V)
    joint = np.einsum("a,ab,abc->bc", p1, p2, p3)
    return joint / joint.sum()


def sampled_pairs(target, spec, sampling, prompt):
    res = generate(
        target, [prompt], dataclasses.replace(sampling, n=N_SAMPLES, max_new_tokens=3, ignore_eos=True), spec
    )
    toks = np.asarray([o["token_ids"][:3] for o in res.outputs])
    counts = np.bincount(toks[:, 1] * V_SMALL + toks[:, 2], minlength=V_SMALL * V_SMALL)
    return counts, res.metrics


def biased_verify(key, logits, draft, n_draft, rs, needs_filter, q=None):
    """The known bug: accept a proposal iff it equals the target argmax, then sample p (not the residual)."""
    from ssd_jax.sampling.filters import categorical
    from ssd_jax.sampling.rejection import VerifyResult

    K = draft.shape[1]
    am = jnp.argmax(logits, -1)[:, :K]
    ok = (draft == am) & (jnp.arange(K)[None] < n_draft[:, None])
    acc = jnp.cumprod(ok.astype(jnp.int32), 1).astype(bool)
    n = acc.sum(1).astype(jnp.int32)
    lp = filter_logprobs(logits, rs, needs_filter)
    nxt = categorical(key, jnp.take_along_axis(lp, n[:, None, None], 1)[:, 0]).astype(
        jnp.int32
    )  # row keys too
    return VerifyResult(n, nxt, acc)


STAT_CASES = [
    ("model", SamplingParams(temperature=1.0, seed=11)),
    ("model", SamplingParams(temperature=0.7, top_p=0.9, seed=12)),
    ("ngram", SamplingParams(temperature=1.0, seed=13)),
    ("ngram", SamplingParams(temperature=0.7, top_p=0.9, seed=14)),
    ("random", SamplingParams(temperature=1.0, seed=15)),
]


@pytest.mark.slow  # superseded in the default set by test_exactness (long horizons, same controls)
@pytest.mark.parametrize("drafter,sampling", STAT_CASES)
def test_sd_matches_exact_target_distribution(small_pair, drafter, sampling, monkeypatch):
    target, draft = small_pair
    prompt = [2, 5, 2, 5, 2] if drafter == "ngram" else [3, 7, 1]
    spec = SpecConfig(method="sd", draft=draft if drafter == "model" else drafter, k=2, prompt_lookup_min=1)
    rs = RowSampling.broadcast(sampling, 1)
    exact = exact_pair_distribution(target, prompt, rs, sampling.needs_filter).ravel()
    counts, m = sampled_pairs(target, spec, sampling, prompt)
    assert counts[exact == 0].sum() == 0  # never a token outside the target's support
    stat, df = chi2_stat(counts, exact, N_SAMPLES)
    assert stat < chi2_threshold(df), (stat, df, m["acceptance_rate"])
    if drafter != "random":
        assert 0.05 < m["acceptance_rate"] < 0.98  # both the accept and the residual paths ran

    if drafter == "model" and sampling.top_p == 1.0:
        # negative control: the biased verifier must fail the very same bound
        monkeypatch.setattr(sd_mod, "verify", biased_verify)
        try:
            with fresh_programs():  # programs of the biased verifier, dropped after
                counts_b, _ = sampled_pairs(target, spec, dataclasses.replace(sampling, seed=99), prompt)
        finally:
            monkeypatch.undo()
        stat_b, df_b = chi2_stat(counts_b, exact, N_SAMPLES)
        assert stat_b > chi2_threshold(df_b), (stat_b, df_b)


@pytest.mark.parametrize("profile", [False, True])
def test_ngram_rounds_without_proposals_are_single_steps(pair, ar_ref, profile):
    """Rounds in which no live row's n-gram lookup matches verify nothing (one target step, not a
    (K+1)-token verify); greedy tokens still equal AR, on the fused and on the profiled loop."""
    target, _ = pair
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    res = generate(target, PROMPTS, sp, SpecConfig(method="sd", draft="ngram", k=3, profile_stages=profile))
    assert _ids(res) == ar_ref
    check_round_accounting(res, 3, fixed_k=False)
    empty = res.metrics["rounds_without_proposals"]
    assert 0 < empty < res.metrics["verify_steps"]
    # a lone one-token prompt has nothing to look up in its first round
    one = generate(
        target,
        [[77]],
        SamplingParams(max_new_tokens=6, ignore_eos=True),
        SpecConfig(method="sd", draft="ngram", k=3, profile_stages=profile),
    )
    assert one.metrics["rounds_without_proposals"] >= 1
    assert one.metrics["acceptance_histogram"][0] >= one.metrics["rounds_without_proposals"]
