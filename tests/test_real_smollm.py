"""Real SmolLM2-135M-Instruct against Hugging Face transformers (CPU torch) loading the same GGUF.

transformers dequantises the GGUF itself (its own reader and its own un-permutation of the
llama Q/K rows), so this is an independent check of our loader and forward on real weights.
Token ids are compared (docs/reference.md §10: the two tokenizers differ on digits for smollm), and
both sides get the same prompt ids.
"""

import numpy as np
import pytest
from test_sd import check_round_accounting

import ssd_jax
from ssd_jax.loading import registry

pytestmark = pytest.mark.realmodel

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Write a short poem about the sea.",
    "<|im_start|>user\nWhat is a linked list?<|im_end|>\n<|im_start|>assistant\n",
]
STEPS = 32


@pytest.fixture(scope="module")
def ours():
    return ssd_jax.load_model("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="module")
def hf_model(ours):
    import torch
    from transformers import AutoModelForCausalLM

    path = registry.gguf_path("smollm2-135m-instruct")
    torch.set_num_threads(2)
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    return m.eval()


def _hf_greedy(model, ids, steps):
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=steps,
        )
    return out[0, len(ids) :].tolist()


# default set: the check a user trusts most (the HF model is already loaded for the logits test), a code
# prompt and a chat-templated one in one batch; the two plain prompts (the same property on two more
# prompts) in the slow set (default-suite budget: code-chat covers it)
@pytest.mark.parametrize(
    "which", [(0, 3), pytest.param((1, 2), marks=pytest.mark.slow)], ids=["code-chat", "plain"]
)
def test_greedy_tokens_match_transformers(ours, hf_model, which):
    prompts = [PROMPTS[i] for i in which]
    ids = [ours.tokenizer.encode(p) for p in prompts]
    got = ssd_jax.generate(ours, ids, ssd_jax.SamplingParams(max_new_tokens=STEPS, ignore_eos=True))
    for p, prompt_ids, out in zip(prompts, ids, got.outputs):
        want = _hf_greedy(hf_model, prompt_ids, STEPS)
        assert out["token_ids"] == want, (p, out["token_ids"], want)


def test_prefill_logits_close_to_transformers(ours, hf_model):
    import jax.numpy as jnp
    import torch

    from ssd_jax.models import llama

    ids = ours.tokenizer.encode(PROMPTS[0] + "\n    if n < 2:\n        return n")
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    h, _ = llama.forward(ours.params, ours.cfg, jnp.asarray([ids]), llama.init_cache(ours.cfg, 1, 64))
    got = np.asarray(llama.logits(ours.params, ours.cfg, h))[0]
    # same dequantised weights, different kernels and summation order: float32 noise only
    assert np.abs(got - ref).max() < 2e-3, np.abs(got - ref).max()


# slow set (default-suite budget): SD's exactness runs on tiny pairs by default (test_sd, test_exactness)
@pytest.mark.parametrize(
    "drafter",
    [
        pytest.param("tiny", marks=pytest.mark.slow),
        pytest.param("ngram", marks=pytest.mark.slow),
        pytest.param("shipped", marks=pytest.mark.slow),
        pytest.param("shipped-vocab2048", marks=pytest.mark.slow),
    ],
)
def test_sd_greedy_equals_ar_on_smollm(ours, drafter):
    """Real target, a different draft (a tiny random model sharing its vocabulary), n-gram lookup,
    or the trained draft shipped in checkpoints/ (the default draft of this target), also with its
    head trimmed to the 2,048 most frequent tokens (its token counts ship next to it)."""
    import dataclasses

    from ssd_jax.models.params import init_params

    if drafter == "tiny":
        cfg = ours.cfg.replace(
            num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
        )
        draft = dataclasses.replace(
            ours, name="tiny-random-draft", cfg=cfg, params=init_params(cfg, 0, scale=0.05)
        )
    elif drafter.startswith("shipped"):
        from ssd_jax.drafters import default_draft

        draft = default_draft("smollm2-135m-instruct", method="model")
        if drafter == "shipped":
            draft = ssd_jax.load_model(draft)
    else:
        draft = "ngram"
    ids = [ours.tokenizer.encode(p) for p in PROMPTS[:3]]
    sp = ssd_jax.SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = ssd_jax.generate(ours, ids, sp)
    vocab = 2048 if drafter == "shipped-vocab2048" else None
    sd = ssd_jax.generate(ours, ids, sp, ssd_jax.SpecConfig(method="sd", draft=draft, k=3, draft_vocab=vocab))
    assert [o["token_ids"] for o in sd.outputs] == [o["token_ids"] for o in ar.outputs]
    from ssd_jax.drafters.vocab import head_vocab

    # the shipped draft was trained with an 8192-token head and loads with it unless told otherwise
    assert (
        sd.metrics.get("draft_vocab") == (vocab or head_vocab(draft)) == {"shipped": 8192}.get(drafter, vocab)
    )
    check_round_accounting(sd, k=3, fixed_k=drafter != "ngram")  # n-gram proposals can be short
    if drafter.startswith("shipped"):  # trained, not random: it agrees with the target well above chance
        assert sd.metrics["acceptance_rate"] > 0.1


@pytest.mark.slow
def test_cli_refuses_a_draft_with_another_tokenizer():
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ssd_jax.decode",
            "--target",
            "smollm2-135m-instruct",
            "--draft",
            "qwen2.5-coder-0.5b-instruct",
            "--method",
            "sd",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if "unknown model" in r.stderr or "could not download" in r.stderr:
        pytest.skip("qwen draft not available offline")
    assert r.returncode == 2, r.stderr[-1500:]
    assert "different tokenizers" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # default-suite budget (15 min on 2 cores): stop strings are also tested on tiny models
def test_stop_strings_cut_the_text(ours):
    sp = ssd_jax.SamplingParams(max_new_tokens=24, ignore_eos=True)
    full = ssd_jax.generate(ours, [PROMPTS[0]], sp).outputs[0]
    text = full["text"]
    # a 3-character stop without whitespace, from the middle of the greedy text
    i = next(j for j in range(len(text) // 2, len(text) - 3) if not any(c.isspace() for c in text[j : j + 3]))
    stop = text[i : i + 3]
    cut = ssd_jax.generate(
        ours, [PROMPTS[0]], ssd_jax.SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop,))
    )
    out = cut.outputs[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[: text.find(stop)]
    assert stop not in out["text"]
    assert full["token_ids"][: len(out["token_ids"])] == out["token_ids"]  # same tokens up to the stop
    # the same stop through SD (n-gram drafter: several tokens per round, cut mid-round)
    sd = ssd_jax.generate(
        ours,
        [PROMPTS[0]],
        ssd_jax.SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop,)),
        ssd_jax.SpecConfig(method="sd", draft="ngram", k=4),
    )
    assert sd.outputs[0]["text"] == out["text"] and sd.outputs[0]["token_ids"] == out["token_ids"]


@pytest.mark.slow  # default-suite budget (15 min on 2 cores): streaming is also tested on tiny models
def test_streamed_text_is_the_decoded_text(ours):
    """Incremental detokenisation: the streamed pieces add up to decode(token_ids), multi-byte
    characters included, at any temperature, and the stop-string cut is the full-text cut."""
    prompts = [
        "Écris une phrase en français avec des accents: é, è, à, ç.",
        "Emoji party: 🎉🚀✨ and 中文 text",
    ]
    sp = ssd_jax.SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=1.0, seed=4)
    pieces = {0: [], 1: []}
    res = ssd_jax.generate(ours, prompts, sp, on_text=lambda row, t: pieces[row].append(t))
    for row, o in enumerate(res.outputs):
        assert o["text"] == ours.tokenizer.decode(o["token_ids"], skip_special_tokens=True)
        assert "".join(pieces[row]) == o["text"]
        assert all(pieces[row])


# slow set (default-suite budget): the default set checks SmolLM2's template against transformers'
# (test_loading.py::test_smollm2_tokenizer_matches_transformers) and that generate(chat=True) applies it
# (test_serve.py's ``offline`` fixture, on the tiny pair with SmolLM2's tokenizer)
@pytest.mark.slow
def test_chat_template_is_applied(ours):
    res = ssd_jax.generate(ours, ["What is 2+2?"], ssd_jax.SamplingParams(max_new_tokens=8), chat=True)
    o = res.outputs[0]
    templ = ours.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert "<|im_start|>" in templ and o["prompt_tokens"] == len(ours.tokenizer.encode(templ))
    assert o["text"].strip()


@pytest.mark.slow  # default-suite budget: SSD's exactness runs on tiny pairs by default (test_exactness, test_ssd)
def test_ssd_greedy_equals_ar_on_smollm(ours):
    """Real target; the draft is its first 8 layers (shares the vocabulary, agrees often enough to hit)."""
    import dataclasses

    cfg = ours.cfg.replace(num_layers=8)
    draft = dataclasses.replace(
        ours,
        name="smollm2-first-8-layers",
        cfg=cfg,
        params={**ours.params, "layers": ours.params["layers"][:8]},
    )
    ids = [ours.tokenizer.encode(p) for p in PROMPTS[:3]]
    sp = ssd_jax.SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = ssd_jax.generate(ours, ids, sp)
    res = ssd_jax.generate(ours, ids, sp, ssd_jax.SpecConfig(method="ssd", draft=draft, k=3, backup="auto"))
    assert [o["token_ids"] for o in res.outputs] == [o["token_ids"] for o in ar.outputs]
    assert res.metrics["cache_hit_rate"] > 0.0
