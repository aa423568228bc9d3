"""The OpenAI-compatible server (``python -m ssd_jax.serve``) in subprocesses on free ports, driven by the
real ``openai`` client and httpx: greedy outputs equal offline ``ssd_jax.generate`` (AR, SD with a draft
model, SD with n-gram), 32 concurrent requests, a disconnect, the 400 / 429 classes, /metrics, a clean
SIGTERM, and the serving benchmark's load generator.

The default set runs on tiny random Llamas (2 layers target, 1 layer draft, width 64) with SmolLM2's
real tokenizer cut to 2,048 tokens and its chat template, so the servers start in seconds; the ``slow`` set runs every test
again on SmolLM2-135M-Instruct and its shipped draft."""

import asyncio
import time

import pytest
from serve_helpers import client, metrics, start, stop

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.realmodel  # SmolLM2's tokenizer comes from the registry

NAME = "served"
PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "One, two, three, four,",
    "Water boils at",
    "Once upon a time",
    "import numpy as np",
    "SELECT * FROM",
    "Dear Sir or Madam,",
]
MAX_TOKENS = [12, 8, 16, 10, 5, 14, 7, 11]
# two attention windows, 80 and 160 slots: short requests run in the first, long ones cross into the second
SERVER_FLAGS = [
    "--served-model-name",
    NAME,
    "--max-model-len",
    "160",
    "--prefill-chunk",
    "16",
    "--context-buckets",
    "2",
    "--batch-buckets",  # rounds of 2 or 4 rows on the 4-slot servers (fewer programs to compile)
    "2",
]


#: the tiny pairs' vocabulary: SmolLM2's tokenizer cut to its first 2,048 tokens (every byte and special token
#: is among them, so any text still round-trips). The whole 49,152 made an SSD round's fan-out of draft rows
#: over the vocabulary most of a served request's time: 15 s for the SSD crowd test against 1.8 s for AR.
SMALL_VOCAB = 2048


def small_tokenizer(n: int = SMALL_VOCAB):
    """SmolLM2-135M-Instruct's tokenizer (BPE) with its chat template, special tokens and ids, its
    vocabulary cut to ids below ``n`` and its merges to those that stay inside it."""
    import json

    import tokenizers

    from ssd_jax.loading import load_numpy
    from ssd_jax.loading.tokenizer import Tokenizer

    full = load_numpy("smollm2-135m-instruct").tokenizer
    spec = json.loads(full.backend.to_str())
    vocab = {t: i for t, i in spec["model"]["vocab"].items() if i < n}

    def inside(merge) -> bool:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        return a in vocab and b in vocab and a + b in vocab

    spec["model"]["vocab"] = vocab
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if inside(m)]
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < n]
    tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
    return Tokenizer(
        tok,
        bos_token_id=full.bos_token_id,
        eos_token_ids=full.eos_token_ids,
        chat_template=full.chat_template,
    )


def _tiny_dir(path, tokenizer, layers: int, seed: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)  # far from uniform logits: greedy ties are unlikely
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save(path)
    return str(path)


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    """(target, draft): tiny random Llamas with SmolLM2's tokenizer cut to 2,048 tokens (its chat template
    and special tokens kept: :func:`small_tokenizer`), or (``slow``) SmolLM2-135M-Instruct itself with its
    shipped draft."""
    if request.param == "smollm2":
        return "smollm2-135m-instruct", "smollm2-135m-draft"
    tok = small_tokenizer()
    root = tmp_path_factory.mktemp("tiny-serve")
    return _tiny_dir(root / "target", tok, 2, 0), _tiny_dir(root / "draft", tok, 1, 1)


class _Servers:
    """Servers of one pair, each started on first use: AR (4 slots), SD with the draft model (K auto,
    calibrated at start-up, 4 slots) and SD with n-gram (K = 3, 2 slots)."""

    FLAGS = {
        "ar": ["--max-batch", "4", "--max-waiting", "40"],
        "sd": [
            "--method",
            "sd",
            "--draft",
            "{draft}",
            "--k",
            "auto",
            "--max-batch",
            "4",
            "--max-waiting",
            "40",
            "--context-buckets",  # one window (K auto compiles every K at every bucket: half the programs)
            "1",
        ],
        "ngram": ["--method", "sd", "--draft", "ngram", "--k", "3", "--max-batch", "2"],
        "eagle": [
            "--method",
            "sd",
            "--draft",
            "{head}",
            "--k",
            "auto",
            "--max-batch",
            "2",
            "--batch-buckets",
            "1",
            "--context-buckets",
            "1",
        ],  # fmt: skip
        "ssd-eagle": [
            "--method",
            "ssd",
            "--draft",
            "{head}",
            "--k",
            "2",
            "--max-batch",
            "2",
            "--context-buckets",
            "1",
        ],
        "ssd": [
            "--method",
            "ssd",
            "--draft",
            "{draft}",
            "--k",
            "2",
            "--max-batch",
            "4",
            "--max-waiting",
            "40",
            "--target-devices",  # SSD's draft on a device of its own (the process sees two)
            "1",
            "--draft-devices",
            "1",
        ],
    }

    def __init__(self, target, draft, tmp):
        self.target, self.draft, self.tmp, self.started = target, draft, tmp, {}

    def head(self) -> str:
        """An EAGLE head for the target: the shipped one for SmolLM2, else a random one saved for it."""
        if not str(self.target).startswith("/"):
            return "smollm2-135m-eagle"
        from ssd_jax import load_model
        from ssd_jax.drafters import eagle

        target = load_model(self.target)
        spec = eagle.HeadSpec(eagle.default_layers(target.cfg.num_layers))
        meta = {"layers": list(spec.layers), "target_sha256": target.weights_sha256, "target": target.name}
        eagle.save_head(
            self.tmp / eagle.HEAD_WEIGHTS, eagle.init_head(target.cfg, spec, seed=2, scale=0.2), meta
        )
        return f"eagle:{self.tmp}"

    def __getitem__(self, name):
        if name not in self.started:
            head = self.head() if name in ("eagle", "ssd-eagle") else ""
            flags = [f.format(draft=self.draft, head=head) for f in self.FLAGS[name]]
            self.started[name] = start(self.target, *SERVER_FLAGS, *flags, devices=2 if name == "ssd" else 1)
        return self.started[name][1]


@pytest.fixture(scope="module")
def servers(pair, tmp_path_factory):
    """Each server must exit 0 without a traceback on SIGTERM; each reports its set-up on start."""
    s = _Servers(*pair, tmp_path_factory.mktemp("head"))
    try:
        yield s
    finally:
        errs = {name: stop(proc) for name, (proc, _) in s.started.items()}
    for name, (rc, err) in errs.items():
        assert rc == 0 and "Traceback" not in err, f"{name}: {err[-2000:]}"
    if "sd" in errs:
        assert "(auto: alpha" in errs["sd"][1]  # the start-up line reports the K it chose
        import re

        # K by running rows: each batch bucket's K (0: AR rounds) and its expected speedup
        plans = re.search(r"by running rows ((?:\d+: K=\d+(?: [0-9.]+x| \(AR\))(?:, )?)+);", errs["sd"][1])
        assert plans is not None, errs["sd"][1][-2000:]
        assert [int(b) for b in re.findall(r"(\d+): K=", plans.group(1))] == [2, 4]
        for k, x in re.findall(r"K=(\d+)(?: ([0-9.]+)x)?", plans.group(1)):
            assert (k == "0") == (x == "") and (k == "0" or float(x) >= 1.0)  # K > 0 only where it pays
    if "ssd" in errs:
        assert "method=ssd" in errs["ssd"][1] and "fan-out budget=6" in errs["ssd"][1]  # 2 (K + 1) branches
        assert "kv=paged" in errs["ssd"][1]  # both models' caches paged, each on its device
    for name, (_, err) in errs.items():
        assert ("windows=160" if name in ("sd", "eagle", "ssd-eagle") else "windows=80,160") in err
    if "eagle" in errs:  # K auto: the default 4 for a head with no stored curve (the tiny pair's random one)
        k = " k=4" if str(s.target).startswith("/") else " k="
        assert k in errs["eagle"][1] and "kv=contiguous" in errs["eagle"][1], errs["eagle"][1][-2000:]
    if "ar" in errs:
        assert "buckets=2,4" in errs["ar"][1]  # AR rounds run 2 or 4 rows (SSD: every slot, "buckets=4")


plain_lp: list = []  # the offline AR log-probabilities of ``offline``'s plain answers (filled by it)


@pytest.fixture(scope="module")
def offline(pair):
    """Offline ``ssd_jax.generate`` (AR): greedy ids per prompt, a chat answer, and a seeded sample."""
    from ssd_jax import SamplingParams, generate, load_model

    model = load_model(pair[0])
    res = generate(model, PROMPTS, SamplingParams(max_new_tokens=max(MAX_TOKENS), logprobs=2))
    plain = [o["token_ids"][:m] for o, m in zip(res.outputs, MAX_TOKENS)]
    plain_lp[:] = [o["logprobs"][:m] for o, m in zip(res.outputs, MAX_TOKENS)]
    chat = generate(model, [PROMPTS[0]], SamplingParams(max_new_tokens=12, logprobs=3), chat=True).outputs[0]
    templ = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    assert "<|im_start|>" in templ and chat["prompt_tokens"] == len(model.tokenizer.encode(templ))
    seeded = generate(
        model, [PROMPTS[1]], SamplingParams(max_new_tokens=10, temperature=0.9, seed=11)
    ).outputs[0]
    return plain, chat, seeded


SYSTEM = " ".join(PROMPTS)  # a shared "system prompt" of several 16-slot blocks


@pytest.fixture(scope="module")
def offline_prefixed(pair):
    from ssd_jax import SamplingParams, generate, load_model

    res = generate(load_model(pair[0]), [SYSTEM + p for p in PROMPTS[:3]], SamplingParams(max_new_tokens=8))
    return [o["token_ids"] for o in res.outputs]


@pytest.mark.parametrize("method", ["ar", "sd", "ssd"])
def test_prefix_caching_reuses_a_shared_prompt(servers, offline_prefixed, method):
    """Three requests sharing a long prompt prefix, one after another: the later ones find its blocks in
    the paged cache's prefix cache (counted in /metrics in vLLM's names) and their greedy output still
    equals offline AR's."""
    url = servers[method]
    c = client(url)
    before = metrics(url)
    for p, ref in zip(PROMPTS[:3], offline_prefixed):
        r = c.completions.create(model=NAME, prompt=SYSTEM + p, max_tokens=8, temperature=0)
        assert r.choices[0].model_extra["token_ids"] == ref
    after = metrics(url)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    queries, hits = d["ssd_jax:prefix_cache_queries_total"], d["ssd_jax:prefix_cache_hits_total"]
    assert 2 * 16 * 2 <= hits < queries, (hits, queries)  # two later requests, at least two blocks each
    assert hits % 16 == 0 and d.get("ssd_jax:num_preemptions_total", 0.0) == 0


def test_openai_client_matches_offline(servers, offline):
    plain, chat, seeded = offline
    c = client(servers["ar"])
    r = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0], temperature=0)
    assert r.choices[0].model_extra["token_ids"] == plain[0]
    assert r.usage.completion_tokens == len(plain[0])
    # streamed: the pieces concatenate to the non-streamed text; usage comes in a last chunk without choices
    s = c.completions.create(
        model=NAME,
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS[0],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(s)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(plain[0]) and not chunks[-1].choices
    m = [{"role": "user", "content": PROMPTS[0]}]
    r = c.chat.completions.create(model=NAME, messages=m, max_tokens=12, temperature=0)
    assert r.choices[0].model_extra["token_ids"] == chat["token_ids"]
    assert r.choices[0].message.content == chat["text"]
    s = c.chat.completions.create(model=NAME, messages=m, max_tokens=12, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == chat["text"]
    # seeded sampling: the tokens of offline generate with that seed (a batch of one)
    r = c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0.9, seed=11)
    assert r.choices[0].model_extra["token_ids"] == seeded["token_ids"]
    assert [x.id for x in c.models.list().data] == [NAME]


# ssd is slow (46 s): the default set serves SSD in test_32_concurrent_requests
@pytest.mark.parametrize(
    "method",
    [
        "sd",
        "eagle",
        pytest.param("ssd", marks=pytest.mark.slow),
        pytest.param("ngram", marks=pytest.mark.slow),
        pytest.param("ssd-eagle", marks=pytest.mark.slow),
    ],
)
def test_sd_servers_match_offline_and_count(servers, offline, method):
    """SD (draft model / n-gram / an EAGLE head) and SSD (draft model / head) greedy outputs equal offline AR, streamed or not;
    spec counters add up, SSD's cache lookups too (one per running row per round that goes on)."""
    url = servers[method]
    c = client(url)
    before = metrics(url)
    for p, m, ref in zip(PROMPTS[:4], MAX_TOKENS, offline[0]):
        r = c.completions.create(model=NAME, prompt=p, max_tokens=m, temperature=0)
        assert r.choices[0].model_extra["token_ids"] == ref
    # the target's log-probabilities of the tokens, as offline AR gives them
    r = c.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0], temperature=0, logprobs=2
    )
    assert r.choices[0].logprobs.token_logprobs == pytest.approx([lp for lp, _ in plain_lp[0]], abs=1e-4)
    s = c.completions.create(
        model=NAME, prompt=PROMPTS[4], max_tokens=MAX_TOKENS[4], temperature=0, stream=True
    )
    assert (
        "".join(ch.choices[0].text for ch in s if ch.choices)
        == c.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=MAX_TOKENS[4], temperature=0)
        .choices[0]
        .text
    )
    after = metrics(url)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts, drafted = (
        d["ssd_jax:spec_decode_num_drafts_total"],
        d["ssd_jax:spec_decode_num_draft_tokens_total"],
    )
    accepted = d["ssd_jax:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 <= accepted <= drafted <= 8 * drafts  # K <= 8 (K auto's range)
    assert (
        sum(v for k, v in d.items() if k.startswith("ssd_jax:spec_decode_num_accepted_tokens_per_pos_total"))
        == accepted
    )
    if method == "sd":  # rounds counted by K (0: an AR round) and batch bucket (2 or 4 rows here)
        rounds = {k: v for k, v in d.items() if k.startswith("ssd_jax:spec_decode_num_rounds_total|") and v}
        assert rounds and all(("batch=2" in k or "batch=4" in k) and "|k=" in k for k in rounds), rounds
    # a row's round emits accepted + 1 tokens; the first token of each request comes from its prefill
    # (the last round of a request may emit more than its max_tokens leave: those are dropped)
    n_req, gen = 7, d["ssd_jax:generation_tokens_total"]
    assert n_req + drafts <= gen <= n_req + drafts + accepted
    if method in ("ssd", "ssd-eagle"):
        # at most K = 2 proposals a round: K from the cache or the neural backup, fewer from a fast one (the
        # server's backup is "auto", which the cost model may send to n-gram lookup: measured on the tiny
        # pair, 26 proposals in 30 rounds with auto, 84 in 42 with --backup neural)
        assert drafted <= 2 * drafts
        lookups, hits = (
            d["ssd_jax:spec_decode_num_cache_lookups_total"],
            d["ssd_jax:spec_decode_num_cache_hits_total"],
        )
        assert 0 < lookups <= drafts and 0 <= hits <= lookups


# ssd in the slow set (default-suite budget): the SSD server is served by test_32_concurrent_requests
@pytest.mark.parametrize("method", ["ar", "sd", pytest.param("ssd", marks=pytest.mark.slow)])
def test_long_generation_crosses_attention_windows(servers, pair, method):
    """A greedy request whose context grows from the 80-slot window into the 160-slot one (a prompt of 2-4
    prefill chunks, 88 new tokens; the SD server has the 160-slot window only) still equals offline AR
    token for token."""
    from ssd_jax import SamplingParams, generate, load_model

    prompt = " ".join(PROMPTS[:7])  # 50 tokens with the tiny pairs' tokenizer (SmolLM2's own: 32)
    ref = generate(load_model(pair[0]), [prompt], SamplingParams(max_new_tokens=88, ignore_eos=True)).outputs[
        0
    ]
    assert 16 < ref["prompt_tokens"] < 64 and ref["prompt_tokens"] + 88 > 80
    r = client(servers[method]).completions.create(
        model=NAME, prompt=prompt, max_tokens=88, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].model_extra["token_ids"] == ref["token_ids"]


def _crowd(url, ids):
    """Requests ``ids`` at once: even ones greedy on PROMPTS[j] (j = i/2), odd ones seeded, sampled with
    top-p / top-k, ``n = 2`` for every fifth; returns {i: (kind, j, [token ids per choice], response ids)}."""

    async def one(ac, i):
        if i % 2 == 0:
            j = (i // 2) % len(PROMPTS)
            r = await ac.completions.create(
                model=NAME, prompt=PROMPTS[j], max_tokens=MAX_TOKENS[j], temperature=0
            )
            return i, ("greedy", j, [r.choices[0].model_extra["token_ids"]], r.id)
        n = 2 if i % 5 == 0 else 1
        r = await ac.completions.create(
            model=NAME,
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=4 + i % 9,
            temperature=0.8,
            top_p=0.9,
            seed=100 + i,
            n=n,
            extra_body={"top_k": 20},
        )
        return i, (
            "seeded",
            n,
            [ch.model_extra["token_ids"] for ch in sorted(r.choices, key=lambda c: c.index)],
            r.id,
        )

    async def all_of():
        ac = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        return dict(await asyncio.gather(*(one(ac, i) for i in ids)))

    return asyncio.run(all_of())


@pytest.mark.parametrize("method", ["ar", "sd", "ssd"])
def test_32_concurrent_requests(servers, offline, method):
    """32 requests of different lengths and parameters on 4 slots: all complete, none lost or duplicated,
    greedy ones equal offline, seeded ones give the same tokens when sent alone where every round ran
    at one K (a row's draws are keyed by its rounds, so K auto's K per bucket is part of them)."""
    url = servers[method]
    before = metrics(url)
    res = _crowd(url, range(32))
    assert sorted(res) == list(range(32)) and len({r[3] for r in res.values()}) == 32
    for i, (kind, j, toks, _) in res.items():
        if kind == "greedy":
            assert toks == [offline[0][j]]
        else:
            assert len(toks) == j and all(1 <= len(t) <= 4 + i % 9 for t in toks)
            if j == 2:
                assert toks[0] != toks[1]  # the two samples of one request draw from their own streams
    alone = _crowd(url, [5, 7])
    ks = {
        k.rsplit("k=", 1)[1]
        for k, v in metrics(url).items()
        if "num_rounds_total|" in k and v > before.get(k, 0)
    }
    assert len(ks) == {"ar": 0, "ssd": 1}.get(method, max(len(ks), 1)), ks  # AR counts no rounds
    if len(ks) <= 1:  # AR, SSD at --k 2, and SD where its plan chose one K at every bucket used
        assert alone[5][2] == res[5][2] and alone[7][2] == res[7][2]
    assert httpx.get(url + "/health").json() == {"status": "ok", "running": 0, "waiting": 0}


def test_disconnect_frees_slot_and_metrics_add_up(servers):
    url = servers["ar"]
    c = client(url)
    n2 = c.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=1, temperature=0).usage.prompt_tokens
    before = metrics(url)
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={"model": NAME, "prompt": PROMPTS[2], "max_tokens": 140, "stream": True, "ignore_eos": True},
        timeout=60,
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leave mid-stream
    deadline = time.time() + 30
    while httpx.get(url + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.1)
    assert httpx.get(url + "/health").json()["running"] == 0
    r = c.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=5, temperature=0)
    after = metrics(url)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert d["ssd_jax:request_success_total|finished_reason=abort"] == 1
    assert d["ssd_jax:request_success_total|finished_reason=length"] == 1
    assert d["ssd_jax:prompt_tokens_total"] == r.usage.prompt_tokens + n2
    assert d["ssd_jax:generation_tokens_total"] >= r.usage.completion_tokens + 1  # the aborted one's too
    assert d["ssd_jax:e2e_request_latency_seconds_count"] == 2
    assert d["ssd_jax:time_to_first_token_seconds_count"] == 2
    assert after["ssd_jax:num_requests_running"] == 0 and after["ssd_jax:num_requests_waiting"] == 0


def test_what_clients_send(servers, offline):
    """As SDKs and benchmark clients send it: chat content as typed text parts (the answer of the plain
    string), logprobs in the chat and completions formats (offline AR's numbers, streamed or not), usage
    in every chunk with continuous_usage_stats, max_completion_tokens; an image part, an option that
    would change the output, and min_tokens above max_tokens get 400 naming the field."""
    _, chat, _ = offline
    c = client(servers["ar"])
    parts = [{"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}]
    r = c.chat.completions.create(
        model=NAME, messages=parts, max_completion_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    assert r.choices[0].model_extra["token_ids"] == chat["token_ids"]
    content = r.choices[0].logprobs.content
    assert [x.logprob for x in content] == pytest.approx([lp for lp, _ in chat["logprobs"]], abs=1e-4)
    assert [[t.logprob for t in x.top_logprobs] for x in content] == [
        pytest.approx([v for _, v in top], abs=1e-4) for _, top in chat["logprobs"]
    ]
    assert len(content) == len(chat["token_ids"]) and all(isinstance(x.token, str) for x in content)
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0], temperature=0, logprobs=2)
    whole = c.completions.create(**kw).choices[0].logprobs
    assert whole.token_logprobs == pytest.approx([lp for lp, _ in plain_lp[0]], abs=1e-4)
    assert all(len(d) <= 3 for d in whole.top_logprobs) and whole.text_offset[0] == 0
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(c.completions.create(**kw, stream=True, stream_options=opts))
    streamed = [
        x
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for x in ch.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(whole.token_logprobs, abs=1e-6)
    used = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert used == sorted(used) and used[-1] == MAX_TOKENS[0] == chunks[-1].usage.completion_tokens
    bad = [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "image_url",
        ),
        ({"messages": parts, "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"messages": parts, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"messages": parts, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": parts, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ]
    for body, field in bad:
        r = httpx.post(servers["ar"] + "/v1/chat/completions", json={"model": NAME, **body}, timeout=30)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_api_key(pair):
    """With an API key the /v1 routes answer 401 (OpenAI's error object) unless the request carries it;
    /health and /metrics stay open. In-process (FastAPI's TestClient), AR on the tiny pair."""
    from fastapi.testclient import TestClient

    from ssd_jax import load_model
    from ssd_jax.decoding.spec import SpecConfig
    from ssd_jax.engine.core import ALL_MODES, Engine
    from ssd_jax.engine.methods import build_method
    from ssd_jax.serve.app import build_app
    from ssd_jax.serve.engine import ServingEngine
    from ssd_jax.serve.metrics import Metrics

    m = Metrics(0)
    method = build_method(load_model(pair[0]), SpecConfig(method="ar"), ALL_MODES, load_model)
    engine = ServingEngine(
        Engine(method, max_batch=1, max_len=64, prefill_chunk=16, metrics=m, admit_together=False)
    )
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    with TestClient(build_app(engine, NAME, m, api_key="s3cret")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_bad_requests_get_400_and_full_queue_429(servers):
    url = servers["ar"]
    post = lambda body, **kw: httpx.post(
        url + "/v1/completions",
        timeout=30,
        **kw,
        **(  # noqa: E731
            {"json": body} if body is not None else {}
        ),
    )
    bad = [
        post(None, content=b"{not json", headers={"content-type": "application/json"}),
        post({"model": "no-such-model", "prompt": "hi"}),
        post({"model": NAME, "prompt": "hi", "temperature": -1}),
        post({"model": NAME, "prompt": "hi", "top_p": 0}),
        post({"model": NAME, "prompt": "hi", "max_tokens": 0}),
        post({"model": NAME}),  # no prompt
        post({"model": NAME, "prompt": "hi " * 200}),  # longer than the 160-token context
        post({"model": NAME, "prompt": "hi", "max_tokens": 1000}),
        post({"model": NAME, "prompt": "hi", "n": 17}),
        httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": []}),
    ]
    for r in bad:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
    # 3 prompts x n = 14: 42 sequences > the 40 that may wait
    r = post({"model": NAME, "prompt": PROMPTS[:3], "max_tokens": 2, "n": 14})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


def test_serving_benchmark_load(servers, tmp_path):
    """The serving benchmark's Poisson load (ssd_jax.bench.serving) on a live server: every request streams
    its tokens and the report's cell adds them up."""
    from ssd_jax.bench import serving as sb

    arrivals = sb.poisson_arrivals(20.0, 6, seed=1)
    reqs = asyncio.run(sb.run_load(servers["sd"], NAME, PROMPTS, arrivals, 6))
    assert [r["tokens"] for r in reqs] == [6] * 6 and all(r["ok"] and 0 < r["ttft"] <= r["e2e"] for r in reqs)
    span = max(r["end"] for r in reqs) - min(r["arrival"] for r in reqs)
    rows = [{"kind": "request", "method": "sd", "rate": 20.0, "repeat": 0, **r} for r in reqs]
    s = sb.cell_summary(rows, [(span, 36)])
    assert s["requests"] == 6 and s["failed"] == 0 and s["throughput"][0] == pytest.approx(36 / span)
    assert s["ttft"]["p50"] <= s["ttft"]["p99"] and s["tpot"]["p50"] > 0
    assert "| 20 req/s | sd | 6 (0) |" in sb.render(rows, {"target": NAME})
    # a closed loop of 2 clients: each sends its next prompt when its last request ends
    closed = asyncio.run(sb.run_closed(servers["sd"], NAME, PROMPTS[:4], 2, 6))
    assert len(closed) == 4 and all(r["ok"] and r["tokens"] == 6 for r in closed)
    starts = sorted(r["start"] for r in closed)
    assert starts[2] >= min(r["end"] for r in closed) - 1e-3  # the third waited for a first to end


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_fails_requests_then_503(pair, stream):
    """A round that raises (a device lost, a bug) fails the running request with an OpenAI-style server
    error (500, or an error event in the stream), and afterwards /health and new requests answer 503
    instead of hanging. In-process (FastAPI's TestClient) with the round replaced by one that raises."""
    import json

    from fastapi.testclient import TestClient

    from ssd_jax import load_model
    from ssd_jax.decoding.spec import SpecConfig
    from ssd_jax.serve.app import build_app
    from ssd_jax.engine.core import ALL_MODES, Engine
    from ssd_jax.engine.methods import build_method
    from ssd_jax.serve.engine import ServingEngine
    from ssd_jax.serve.metrics import Metrics

    m = Metrics(0)
    method = build_method(load_model(pair[0]), SpecConfig(method="ar"), ALL_MODES, load_model)
    core = Engine(method, max_batch=2, max_len=64, prefill_chunk=16, metrics=m, admit_together=False)
    engine = ServingEngine(core)

    def boom(*args):
        raise RuntimeError("device lost\nwhile decoding")

    method.dispatch = boom  # every round raises
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    with TestClient(build_app(engine, NAME, m)) as c:
        if stream:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
            assert r.status_code == 200 and events[-1]["error"]["type"] == "server_error"
            assert "device lost while decoding" in events[-1]["error"]["message"]
        else:
            r = c.post("/v1/completions", json=body)
            assert (
                r.status_code == 500
                and "RuntimeError: device lost while decoding" in r.json()["error"]["message"]
            )
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "error"
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
