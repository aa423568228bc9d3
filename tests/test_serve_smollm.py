"""The OpenAI-compatible server (``python -m ssd_jax.serve``), started in a subprocess on SmolLM2-135M and
driven by the real ``openai`` client and httpx: offline-equal greedy outputs (AR, SD n-gram), concurrent
requests, a disconnect, the 400 / 429 classes, /metrics, and a clean SIGTERM.

All ``slow`` (each server takes ~30 s of loading and compiling on 2 cores, the offline references as
much again): the default set runs the same checks on tiny random models with SmolLM2's tokenizer
(tests/test_serve.py)."""

import asyncio
import time

import pytest
from serve_helpers import client, metrics, start, stop

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fib(n):", "One, two, three, four,", "Water boils at"]
MAX_TOKENS = [12, 8, 16, 10]


def _start(*flags):
    return start(MODEL, "--max-model-len", "256", "--prefill-chunk", "32", *flags)


@pytest.fixture(scope="module")
def ar_server():
    proc, url = _start("--max-batch", "3", "--max-waiting", "12")
    yield url
    rc, err = stop(proc)
    assert rc == 0 and "Traceback" not in err, err[-2000:]


@pytest.fixture(scope="module")
def offline():
    """Greedy token ids of ``ssd_jax.generate`` (AR) for PROMPTS, plain and through the chat template."""
    from ssd_jax import SamplingParams, generate, load_model

    model = load_model(MODEL)
    plain = [generate(model, [p], SamplingParams(max_new_tokens=m)).outputs[0]["token_ids"]
             for p, m in zip(PROMPTS, MAX_TOKENS)]
    chat = generate(model, [PROMPTS[0]], SamplingParams(max_new_tokens=12), chat=True).outputs[0]
    seeded = generate(model, [PROMPTS[1]], SamplingParams(max_new_tokens=10, temperature=0.9, seed=11)).outputs[0]
    return plain, chat, seeded


@pytest.mark.slow  # with the offline references: ~75 s on 2 busy cores
def test_openai_client_matches_offline(ar_server, offline):
    plain, chat, seeded = offline
    c = client(ar_server)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0], temperature=0)
    assert r.choices[0].model_extra["token_ids"] == plain[0]
    assert r.usage.completion_tokens == len(plain[0])
    # streaming completion: the text pieces concatenate to the non-streamed text; usage in the last chunk
    s = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0], temperature=0, stream=True,
                             stream_options={"include_usage": True})
    chunks = list(s)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(plain[0]) and not chunks[-1].choices
    # chat, non-streamed and streamed
    m = [{"role": "user", "content": PROMPTS[0]}]
    r = c.chat.completions.create(model=MODEL, messages=m, max_tokens=12, temperature=0)
    assert r.choices[0].model_extra["token_ids"] == chat["token_ids"]
    assert r.choices[0].message.content == chat["text"]
    s = c.chat.completions.create(model=MODEL, messages=m, max_tokens=12, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == chat["text"]
    # a seeded sampled request: the same tokens as offline generate with that seed (batch of one)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0.9, seed=11)
    assert r.choices[0].model_extra["token_ids"] == seeded["token_ids"]
    models = c.models.list()
    assert [x.id for x in models.data] == [MODEL]


@pytest.mark.slow
def test_concurrent_requests(ar_server, offline):
    """Requests of different lengths and parameters at once (more than the 3 slots): all complete, greedy
    ones equal offline, seeded ones are reproducible whatever their neighbours; nothing lost or duplicated."""
    plain = offline[0]

    async def one(ac, i):
        if i % 2 == 0:
            j = (i // 2) % len(PROMPTS)
            r = await ac.completions.create(model=MODEL, prompt=PROMPTS[j], max_tokens=MAX_TOKENS[j], temperature=0)
            return ("greedy", j, r.choices[0].model_extra["token_ids"])
        r = await ac.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6 + i, temperature=0.8, top_p=0.9,
                                        seed=100 + i, n=2 if i == 3 else 1, extra_body={"top_k": 20})
        return ("seeded", i, [ch.model_extra["token_ids"] for ch in r.choices])

    async def all_of(ids):
        ac = openai.AsyncOpenAI(base_url=ar_server + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(ac, i) for i in ids))

    res = asyncio.run(all_of(range(10)))
    assert len(res) == 10
    for kind, j, toks in res:
        if kind == "greedy":
            assert toks == plain[j]
        else:
            assert all(len(t) <= 6 + j for t in toks) and len(toks) == (2 if j == 3 else 1)
    again = asyncio.run(all_of([3, 5]))  # alone now: the same tokens as in the crowd
    assert again[0][2] == [t for k, i, t in res if i == 3][0]
    assert again[1][2] == [t for k, i, t in res if i == 5][0]


def test_disconnect_frees_slot_and_metrics_add_up(ar_server):
    c = client(ar_server)
    n2 = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=1, temperature=0).usage.prompt_tokens
    before = metrics(ar_server)
    with httpx.stream("POST", ar_server + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[2],
                      "max_tokens": 200, "stream": True, "ignore_eos": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leave mid-stream
    deadline = time.time() + 30
    while httpx.get(ar_server + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(ar_server + "/health").json()["running"] == 0
    r = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=5, temperature=0)
    after = metrics(ar_server)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert d["ssd_jax:request_success_total|finished_reason=abort"] == 1
    assert d["ssd_jax:request_success_total|finished_reason=length"] == 1
    assert d["ssd_jax:prompt_tokens_total"] == r.usage.prompt_tokens + n2
    # the finished request's tokens are counted (the aborted one's streamed tokens too)
    assert d["ssd_jax:generation_tokens_total"] >= r.usage.completion_tokens
    assert d["ssd_jax:e2e_request_latency_seconds_count"] == 2
    assert after["ssd_jax:num_requests_running"] == 0


def test_bad_requests_get_400_and_full_queue_429(ar_server):
    post = lambda body, **kw: httpx.post(ar_server + "/v1/completions", timeout=30, **kw, **(
        {"json": body} if body is not None else {}))
    bad = [
        post(None, content=b"{not json", headers={"content-type": "application/json"}),
        post({"model": "no-such-model", "prompt": "hi"}),
        post({"model": MODEL, "prompt": "hi", "temperature": -1}),
        post({"model": MODEL, "prompt": "hi", "top_p": 0}),
        post({"model": MODEL, "prompt": "hi", "max_tokens": 0}),
        post({"model": MODEL}),  # no prompt
        post({"model": MODEL, "prompt": "hi " * 300}),  # longer than the 256-token context
        post({"model": MODEL, "prompt": "hi", "max_tokens": 1000}),
        httpx.post(ar_server + "/v1/chat/completions", json={"model": MODEL, "messages": []}),
    ]
    for r in bad:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
    r = post({"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 13})  # 13 sequences > the 12 that may wait
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.slow
def test_sd_ngram_server_matches_offline(offline):
    """SD with the n-gram drafter: greedy outputs equal offline AR (exactness), spec counters add up."""
    proc, url = _start("--method", "sd", "--draft", "ngram", "--k", "3", "--max-batch", "2")
    try:
        c = client(url)
        for p, m, ref in zip(PROMPTS[:3], MAX_TOKENS, offline[0]):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=m, temperature=0)
            assert r.choices[0].model_extra["token_ids"] == ref
        mt = metrics(url)
        assert mt["ssd_jax:spec_decode_num_drafts_total"] > 0
        assert mt["ssd_jax:spec_decode_num_accepted_tokens_total"] <= mt["ssd_jax:spec_decode_num_draft_tokens_total"]
        per_pos = sum(v for k, v in mt.items() if k.startswith("ssd_jax:spec_decode_num_accepted_tokens_per_pos_total"))
        assert per_pos == mt["ssd_jax:spec_decode_num_accepted_tokens_total"]
        # every round emits accepted + 1 tokens per row
        assert mt["ssd_jax:generation_tokens_total"] <= (mt["ssd_jax:spec_decode_num_accepted_tokens_total"]
                                                         + mt["ssd_jax:spec_decode_num_drafts_total"] + 3)
    finally:
        rc, err = stop(proc)
    assert rc == 0 and "Traceback" not in err, err[-2000:]

