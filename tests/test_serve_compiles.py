"""A warm server compiles nothing while it serves: driven over every batch bucket, every attention window
and every kind of sampling, ``ssd_jax:xla_compilations_total{phase="serving"}`` in /metrics stays 0.

One server in the default set (SD with a draft model, two windows and two buckets, on tiny random Llamas
whose prompts are token ids: no tokenizer), started with ``--log-level warning``, which leaves none of its
start-up lines on stderr; the ``slow`` set adds ``--context-buckets 6 --batch-buckets 7`` (AR, 64 slots:
84 round programs), a configuration whose programs the fixed-size caches evicted, to be compiled again
while it served."""

import concurrent.futures

import pytest
from serve_helpers import metrics, start, stop

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

VOCAB = 128


def _tiny(path, layers: int, seed: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=1,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-compiles")
    return _tiny(root / "target", 2, 0), _tiny(root / "draft", 1, 1)


SAMPLINGS = [{"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 0.8, "top_k": 5, "top_p": 0.9}]


def _complete(url, i: int, prompt_len: int, max_tokens: int):
    body = {
        "prompt": [2 + (i * 7 + j) % (VOCAB - 2) for j in range(prompt_len)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": i,
        **SAMPLINGS[i % len(SAMPLINGS)],
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _drive(url, buckets, max_len: int, reach: int) -> None:
    """Rounds of every bucket (``n`` requests together fill slots 0..n-1: the round runs bucket ``n``), each
    sampling kind in each, and at the first bucket one request whose prompt is prefilled in chunks through
    every window and one that decodes through every window (``reach``: the slots past its context a round
    may write)."""
    with concurrent.futures.ThreadPoolExecutor(max(buckets) + 2) as pool:
        for n in buckets:
            jobs = [pool.submit(_complete, url, i, 4 + i % 5, 6 + (i % 3)) for i in range(n)]
            if n == buckets[0]:
                jobs.append(pool.submit(_complete, url, 100, max_len - reach - 8, 2))  # prefill: every window
                jobs.append(pool.submit(_complete, url, 101, 8, max_len - reach - 16))  # decode: every window
            for j in jobs:
                j.result()


def _serving_compiles(url) -> tuple[float, float]:
    m = metrics(url)
    return m["ssd_jax:xla_compilations_total|phase=warmup"], m["ssd_jax:xla_compilations_total|phase=serving"]


def test_warm_sd_server_compiles_nothing_while_serving(pair):
    target, draft = pair
    proc, url = start(
        target, "--method", "sd", "--draft", draft, "--k", "2", "--max-batch", "4", "--max-model-len", "256",
        "--prefill-chunk", "32", "--context-buckets", "2", "--batch-buckets", "2", "--log-level", "warning",
    )  # fmt: skip
    try:
        _drive(url, [2, 4], 256, reach=2 * 3)
        warm, serving = _serving_compiles(url)
        rounds = {k for k in metrics(url) if k.startswith("ssd_jax:spec_decode_num_rounds_total")}
    finally:
        rc, err = stop(proc)
    assert warm > 0 and serving == 0, (warm, serving, err[-3000:])
    assert {r.split("batch=")[1].split("|")[0] for r in rounds} == {"2", "4"}  # both buckets ran
    assert rc == 0 and "[serve]" not in err and "plan:" not in err, err[-3000:]  # warning: no start-up lines


@pytest.mark.slow  # ~1 min: 84 AR round programs to compile
def test_many_buckets_and_windows_compile_nothing_while_serving(pair):
    proc, url = start(
        pair[0], "--max-batch", "64", "--max-model-len", "1024", "--prefill-chunk", "64",
        "--context-buckets", "6", "--batch-buckets", "7",
    )  # fmt: skip
    try:
        _drive(url, [1, 2, 4, 8, 16, 32, 64], 1024, reach=1)
        warm, serving = _serving_compiles(url)
    finally:
        rc, err = stop(proc)
    assert warm > 0 and serving == 0, (warm, serving, err[-3000:])
    assert "windows=32,64,128,256,512,1024" in err and "buckets=1,2,4,8,16,32,64" in err, err[-3000:]
    assert rc == 0
