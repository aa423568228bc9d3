"""Self-distillation: the data cache (resume, recipe refusal, atomic shards), the stored-top-k loss
against numpy, training on it (with resume), the prompt splits, and drafts loaded by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import chex
import numpy as np
import pytest
from test_train import TARGET_CFG, Killed, restore_state, save_tiny_target

from ssd_jax import training as T
from ssd_jax.errors import UserError
from ssd_jax.loading import draft as dfmt
from ssd_jax.loading import load_model
from ssd_jax.training import distill as D
from ssd_jax.training import distill_data as DD

WORDS = "the quick brown fox jumps over the lazy dog and hello world again".split()
PROMPTS = [
    {"id": f"p/{i}", "prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 5))}
    for i in range(6)
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    save_tiny_target(root, "cd")
    return root


@pytest.fixture(scope="module")
def target(env):
    return load_model(env / "target")


def recipe(env, **kw) -> DD.DistillRecipe:
    base = dict(
        target=str(env / "target"),
        n_prompts=6,
        temperatures=(0.0, 1.0),
        top_k=8,
        max_new_tokens=8,
        max_prompt_tokens=16,
        batch_size=2,
        shard_prompts=2,
    )
    return DD.DistillRecipe(**{**base, **kw})


def build(env, target, out, **kw):
    return DD.build_distill_data(
        recipe(env, **kw.pop("r", {})), env / out, target=target, prompts=PROMPTS, **kw
    )


@pytest.fixture(scope="module")
def data_a(env, target):
    build(env, target, "data-a")
    return DD.load_distill_data(env / "data-a")


def _arrays(d: DD.DistillData):
    return [d.tokens, d.offsets, d.prompt_lens, d.topk_ids, d.topk_logprobs]


def test_data_holds_the_targets_answers_and_top_k(env, target, data_a):
    from ssd_jax.engine import generate
    from ssd_jax.sampling.filters import SamplingParams

    assert data_a.n == 12 and data_a.topk_ids.shape[1] == 8
    # the T = 0 shard of the first two prompts: greedy continuations of the chat-templated prompts
    ids = [DD.encode_prompt(target.tokenizer, r["prompt"], 16, True) for r in PROMPTS[:2]]
    res = generate(target, ids, SamplingParams(max_new_tokens=8))
    for i in range(2):
        seq = data_a.tokens[data_a.offsets[i] : data_a.offsets[i + 1]]
        assert list(seq) == ids[i] + res.outputs[i]["token_ids"]
    # top-k rows equal the target's log-softmax at each generated position (a direct forward)
    seq = data_a.tokens[data_a.offsets[0] : data_a.offsets[1]]
    p = int(data_a.prompt_lens[0])
    logits = np.asarray(T.causal_logits(target.params, target.cfg, seq[None, :].astype(np.int32)))[0]
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    rows = slice(int(data_a.gen_offsets[0]), int(data_a.gen_offsets[1]))
    want = np.take_along_axis(lp[p - 1 : len(seq) - 1], data_a.topk_ids[rows], axis=-1)
    np.testing.assert_allclose(data_a.topk_logprobs[rows], want, atol=2e-5)
    assert np.all(np.diff(data_a.topk_logprobs[rows], axis=-1) <= 1e-6)  # sorted, most likely first
    assert np.all(np.exp(data_a.topk_logprobs).sum(-1) <= 1 + 1e-5)  # real log-probs, not renormalised


def test_resume_after_a_kill_between_shards(env, target, data_a):
    written = []

    def kill(name):
        written.append(name)
        if len(written) == 2:
            raise Killed

    with pytest.raises(Killed):
        build(env, target, "data-b", on_shard=kill)
    out = env / "data-b"
    (out / ".shard-t0-00002.npz.tmp-99999").write_bytes(b"half a shard")  # what a kill mid-write leaves
    with pytest.raises(UserError, match="incomplete"):
        DD.load_distill_data(out)
    s = build(env, target, "data-b")
    assert (s["shards_kept"], s["shards_written"]) == (2, 4)
    assert s["compiles"] == 0  # the prompt widths of data-a: nothing new to compile for more shards
    assert not list(out.glob(".*tmp*"))
    for a, b in zip(_arrays(data_a), _arrays(DD.load_distill_data(out))):
        np.testing.assert_array_equal(a, b)
    # a damaged shard is regenerated, the rest kept
    (out / DD.shard_name(1, 0)).write_bytes(b"PK\x03\x04 truncated")
    s = build(env, target, "data-b")
    assert (s["shards_kept"], s["shards_written"]) == (5, 1)
    # more prompts, same recipe: the complete shards are kept (the prompt list is prefix-stable)
    s = DD.build_distill_data(recipe(env, n_prompts=6), out, target=target, prompts=PROMPTS)
    assert s["shards_written"] == 0


def test_a_different_recipe_is_refused(env, target, data_a):
    with pytest.raises(UserError, match=r"different recipe \(top_k: 8 -> 4\)") as e:
        build(env, target, "data-a", r={"top_k": 4})
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="temperatures"):
        build(env, target, "data-a", r={"temperatures": (0.0,)})


def test_shard_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "x.npz"
    DD.write_atomic(path, b"old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(DD.os, "replace", boom)
    with pytest.raises(OSError):
        DD.write_atomic(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["x.npz"]
    monkeypatch.undo()
    arrays = {k: np.arange(6, dtype=np.int32).reshape(3, 2) for k in DD.SHARD_ARRAYS}
    DD.write_atomic(path, DD.shard_bytes(arrays, {"a": 1}))
    got, meta = DD.read_shard(path)
    assert meta == {"a": 1} and np.array_equal(got["topk_ids"], arrays["topk_ids"])
    path.write_bytes(DD.shard_bytes(arrays, {"a": 1})[:100])
    assert DD.read_shard(path) is None


# --- the loss ------------------------------------------------------------------------------------
def _np_reference(z, ids, lp, labels, head_mask, tail):
    """Per-position KL and CE in float64, written from the definitions."""
    z = z.astype(np.float64)
    if head_mask is not None:
        z = np.where(head_mask, z, -np.inf)
    lq = z - z.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    q = np.exp(lq)
    kl = np.zeros(ids.shape[:2])
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            keep = np.ones(ids.shape[2], bool) if head_mask is None else head_mask[ids[b, t]]
            p = np.exp(lp[b, t].astype(np.float64))
            pk, qk = p[keep], q[b, t, ids[b, t][keep]]
            if tail == "renorm":
                pn = pk / pk.sum()
                kl[b, t] = np.sum(pn * (np.log(pn) - np.log(qk)))
            else:
                pt, qt = 1 - pk.sum(), 1 - q[b, t, ids[b, t]].sum()
                kl[b, t] = np.sum(pk * (np.log(pk) - np.log(qk))) + pt * (np.log(pt) - np.log(qt))
    ce = -np.take_along_axis(lq, labels[..., None], -1)[..., 0]
    return kl, ce


@pytest.mark.parametrize("tail", ["bucket", "renorm"])
@pytest.mark.parametrize("trimmed", [False, "mask", "gather"])
def test_topk_kl_matches_numpy(tail, trimmed):
    rng = np.random.default_rng(1)
    B, Tn, V, K = 2, 5, 40, 6
    z = rng.normal(size=(B, Tn, V)).astype(np.float32) * 2
    zt = rng.normal(size=(B, Tn, V)) * 2
    lpt = zt - np.log(np.exp(zt).sum(-1, keepdims=True))
    ids = np.argsort(-lpt, -1)[..., :K].astype(np.int32)
    lp = np.take_along_axis(lpt, ids, -1).astype(np.float32)
    labels = ids[..., 0]
    mask = None
    if trimmed:
        mask = np.ones(V, bool)
        mask[ids[0, 0, 1]] = mask[ids[1, 2, 0]] = mask[30:] = False  # some top-k ids and a tail cut off
    if trimmed == "gather":  # the train step's form: logits of the kept ids only, and each id's column
        kept = np.flatnonzero(mask).astype(np.int32)
        col = np.full(V, -1, np.int32)
        col[kept] = np.arange(kept.size)
        st = D.distill_stats(z[..., kept], ids, lp, labels, None, tail, col)
    else:
        st = D.distill_stats(z, ids, lp, labels, mask, tail)
    kl, ce = _np_reference(z, ids, lp, labels, mask, tail)
    np.testing.assert_allclose(np.asarray(st["kl"]), kl, rtol=1e-4, atol=1e-5)
    ok = np.asarray(st["ce_ok"])
    np.testing.assert_allclose(np.asarray(st["ce"])[ok], ce[ok], rtol=1e-5)
    assert bool(trimmed) == (not ok.all())
    # KL is 0 for a draft equal to the target (untrimmed): the bucket form is exact then
    if not trimmed:
        st0 = D.distill_stats(zt.astype(np.float32), ids, lp, labels, None, tail)
        if tail == "bucket":
            np.testing.assert_allclose(np.asarray(st0["kl"]), 0, atol=1e-5)


def test_kl_ce_mix():
    rng = np.random.default_rng(2)
    st = {"kl": rng.random((2, 4)), "ce": rng.random((2, 4)), "ce_ok": rng.random((2, 4)) > 0.3}
    m = (rng.random((2, 4)) > 0.4).astype(np.float32)
    for w in (0.0, 0.3, 1.0):
        loss, kl, ce = (float(x) for x in D.distill_loss(st, m, w))
        want_kl = (st["kl"] * m).sum() / m.sum()
        mc = m * st["ce_ok"]
        want_ce = (st["ce"] * mc).sum() / mc.sum()
        assert kl == pytest.approx(want_kl, rel=1e-6) and ce == pytest.approx(want_ce, rel=1e-6)
        assert loss == pytest.approx((1 - w) * want_kl + w * want_ce, rel=1e-6)


def test_batches_align_top_k_with_the_predicted_token(data_a):
    """Each example is its sequence, right-padded; the masked rows are its generated tokens' top-k."""
    L = 64
    assert np.diff(data_a.offsets).max() <= L + 1
    b = D.distill_batch(data_a, 0, 0, 12, L)
    order = D._perm(0, 0, 12)
    assert b["mask"].sum() == (np.diff(data_a.offsets) - data_a.prompt_lens).sum()
    for r in range(12):
        e = int(order[r])
        seq = data_a.tokens[data_a.offsets[e] : data_a.offsets[e + 1]]
        p = int(data_a.prompt_lens[e])
        assert b["tokens"][r, : len(seq)].tolist() == seq.tolist() and not b["tokens"][r, len(seq) :].any()
        pos = np.nonzero(b["mask"][r])[0]
        assert pos.tolist() == list(range(p - 1, len(seq) - 1))
        rows = slice(int(data_a.gen_offsets[e]), int(data_a.gen_offsets[e + 1]))
        np.testing.assert_array_equal(b["topk_logprobs"][r, pos], data_a.topk_logprobs[rows])
        if e < 6:  # the T = 0 shards come first: the stored token is the target's top-1
            assert np.array_equal(b["tokens"][r, pos + 1], b["topk_ids"][r, pos, 0])


def _packed(data, L=128):
    rows = D.batch_rows(data, 0, 0, 3, L, pack=True)
    assert max(len(r) for r in rows) >= 2
    return rows


def test_packing_covers_each_sequence_once_per_epoch_and_is_a_function_of_seed_and_step(data_a):
    L = 128
    plan = D.pack_epoch(data_a, 0, 0, L)
    assert sorted(e for r in plan for e in r) == list(range(data_a.n))
    assert all(np.diff(data_a.offsets)[r].sum() <= L + 1 for r in plan)
    # a fresh copy (no cached plans) gives the same rows for a late step, without the earlier steps
    fresh = DD.load_distill_data(data_a.info["data"])
    for step in (7, 0, 3):
        assert D.batch_rows(fresh, step, 0, 3, L, True) == D.batch_rows(data_a, step, 0, 3, L, True)
    assert D.batch_rows(fresh, 0, 1, 3, L, True) != D.batch_rows(fresh, 0, 0, 3, L, True)


def _logits(params, cfg, tokens, positions=None, segments=None):
    import jax

    return np.asarray(jax.jit(T.causal_logits, static_argnums=1)(params, cfg, tokens, positions, segments))


def test_packed_forward_equals_each_sequence_alone(target, data_a):
    rows = _packed(data_a)
    b = D.fill_rows(data_a, rows, 128)
    z = _logits(target.params, target.cfg, b["tokens"][:, :-1], b["positions"], b["segments"])
    alone = D.fill_rows(data_a, [[e] for r in rows for e in r], 128)  # one sequence a row, right-padded
    za = _logits(target.params, target.cfg, alone["tokens"][:, :-1])
    i = 0
    for r, members in enumerate(rows):
        o = 0
        for e in members:
            n = min(
                int(data_a.offsets[e + 1] - data_a.offsets[e]), 128 - o
            )  # the row's last token is a label only
            np.testing.assert_allclose(z[r, o : o + n], za[i, :n], atol=2e-5, rtol=1e-5)
            o, i = o + n, i + 1


def test_packed_loss_equals_the_unpacked_loss_on_the_same_sequences(target, data_a):
    import jax

    draft = jax.tree.map(lambda x: x * 1.1, target.params)  # not the target itself: KL > 0
    rows = _packed(data_a)
    losses = []
    for rr in (rows, [[e] for r in rows for e in r]):
        b = D.fill_rows(data_a, rr, 128)
        tokens = b["tokens"]
        z = _logits(draft, target.cfg, tokens[:, :-1], b["positions"], b["segments"])
        st = D.distill_stats(z, b["topk_ids"], b["topk_logprobs"], tokens[:, 1:])
        losses.append([float(x) for x in D.distill_loss(st, b["mask"], 0.25)] + [b["mask"].sum()])
    assert losses[0][1] > 1e-3
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_gathered_head_loss_and_grads_equal_the_masked_full_head(target, data_a):
    """The train step computes a trimmed head's kept rows only; loss and gradients are those of the
    full head with the other ids masked (what decoding's trimmed draft samples from)."""
    import jax
    import jax.numpy as jnp

    from ssd_jax.training.objective import causal_hidden, kept_logits

    cfg, V = target.cfg, target.cfg.vocab_size
    mask = np.zeros(V, bool)
    mask[np.random.default_rng(3).permutation(V)[: V // 3]] = True
    ids = np.flatnonzero(mask).astype(np.int32)
    col = np.full(V, -1, np.int32)
    col[ids] = np.arange(ids.size)
    b = D.fill_rows(data_a, [[0], [1]], 64)
    tokens, labels = b["tokens"][:, :-1], b["tokens"][:, 1:]

    def loss(params, gathered):
        h = causal_hidden(params, cfg, tokens, b["positions"], b["segments"])
        if gathered:
            st = D.distill_stats(
                kept_logits(params, cfg, h, ids),
                b["topk_ids"],
                b["topk_logprobs"],
                labels,
                None,
                "bucket",
                col,
            )
        else:
            st = D.distill_stats(
                T.causal_logits(params, cfg, tokens, b["positions"], b["segments"]),
                b["topk_ids"],
                b["topk_logprobs"],
                labels,
                jnp.asarray(mask),
            )
        return D.distill_loss(st, b["mask"], 0.1)[0]

    draft = jax.tree.map(lambda x: x * 1.05, target.params)
    (la, ga), (lb, gb) = (
        jax.jit(jax.value_and_grad(loss), static_argnums=1)(draft, g) for g in (True, False)
    )
    assert float(la) > 1e-3
    np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
    chex.assert_trees_all_close(ga, gb, rtol=1e-4, atol=1e-6)


# --- training on it --------------------------------------------------------------------------------
def targs(env, data, out, **kw) -> T.TrainArgs:
    base = dict(
        target=str(env / "target"),
        size="40K",
        steps=6,
        batch_size=4,
        seq_len=32,
        lr=3e-3,
        warmup=1,
        eval_every=3,
        eval_windows=4,
        loss="distill",
        ce_weight=0.25,
        data=str(env / data),
        out=str(env / out),
    )
    return T.TrainArgs(**{**base, **kw})


@pytest.fixture(scope="module")
def run_a(env, data_a):
    return T.train(targs(env, "data-a", "run-a"), corpus=_heldout(env))


def _heldout(env):
    rng = np.random.default_rng(0)
    s = rng.integers(3, TARGET_CFG.vocab_size, 2000).astype(np.int32)
    return T.Corpus(s, s, {"data": "test", "train": {"sha256": "x"}, "heldout": {}})


def test_distill_training_lowers_the_loss_and_resumes(env, run_a):
    import json

    recs = [json.loads(x) for x in (env / "run-a" / "train_log.jsonl").read_text().splitlines()]
    assert recs[-1]["loss"] < recs[0]["loss"] and all(r["tokens"] > 0 for r in recs)
    meta = dfmt.read_meta(env / "run-a")
    assert meta["train"]["args"]["loss"] == "distill" and meta["train"]["data"]["train"]["top_k"] == 8

    def kill(step, rec):
        if step == 4:
            raise Killed

    with pytest.raises(Killed):
        T.train(targs(env, "data-a", "run-b"), corpus=_heldout(env), on_step=kill)
    T.train(targs(env, "data-a", "run-b", resume=True), corpus=_heldout(env))
    a, b = restore_state(env / "run-a", 6), restore_state(env / "run-b", 6)
    chex.assert_trees_all_equal(a["params"], b["params"])
    chex.assert_trees_all_equal(a["opt_state"], b["opt_state"])
    with pytest.raises(UserError, match="ce-weight"):
        T.train(targs(env, "data-a", "run-b", resume=True, ce_weight=0.5), corpus=_heldout(env))


def test_packed_training_resumes_with_the_same_batches(env, data_a):
    kw = dict(pack=True, steps=4, eval_every=2, batch_size=2, seq_len=128)

    def kill(step, rec):
        if step == 3:
            raise Killed

    full = T.train(targs(env, "data-a", "run-p", **kw), corpus=_heldout(env))
    with pytest.raises(Killed):
        T.train(targs(env, "data-a", "run-q", **kw), corpus=_heldout(env), on_step=kill)
    T.train(targs(env, "data-a", "run-q", resume=True, **kw), corpus=_heldout(env))
    chex.assert_trees_all_equal(
        restore_state(env / "run-p", 4)["params"], restore_state(env / "run-q", 4)["params"]
    )
    assert full["timing"]["loss_tokens_per_s"] > 0
    with pytest.raises(UserError, match="pack"):
        T.train(targs(env, "data-a", "run-q", resume=True, **{**kw, "pack": False}), corpus=_heldout(env))


@pytest.mark.slow  # default-suite budget (15 min on 2 cores): trimmed heads are tested in test_vocab_trim
def test_trimmed_head_training(env, data_a, monkeypatch):
    from ssd_jax.drafters import vocab

    counts = np.arange(TARGET_CFG.vocab_size)[::-1].astype(np.int64)
    monkeypatch.setattr(vocab, "draft_token_counts", lambda model, source=None: counts)
    s = T.train(targs(env, "data-a", "run-v", steps=2, eval_every=0, draft_vocab=100), corpus=_heldout(env))
    assert s["step"] == 2 and np.isfinite(s["eval"]["alpha"])
    from ssd_jax import load_model

    assert vocab.head_vocab(load_model(env / "run-v")) == 100  # it decodes with the head it was trained with
    with pytest.raises(UserError, match="--loss distill only"):
        T.TrainArgs(target="x", draft_vocab=100, loss="kl").check()


# --- loading by name and the prompt splits -----------------------------------------------------
def test_drafts_load_by_name_from_any_directory(env, run_a, tmp_path, monkeypatch):
    from ssd_jax.engine import generate
    from ssd_jax.sampling.filters import SamplingParams
    from ssd_jax.decoding.spec import SpecConfig

    root = tmp_path / "ckpts"
    shutil.copytree(env / "run-a" / "best", root / "tiny-draft")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    repo = Path(__file__).resolve().parents[1]
    assert dfmt.resolve_draft("smollm2-135m-draft") == repo / "checkpoints" / "smollm2-135m-draft"
    with pytest.raises(UserError, match="unknown model 'tiny-draft'"):
        load_model("tiny-draft")
    monkeypatch.setenv(dfmt.CHECKPOINTS_ENV, str(root))
    d = load_model("tiny-draft")
    assert d.cfg.num_layers >= 1
    target = load_model(env / "target")
    res = generate(
        target,
        [[5, 6, 7]],
        SamplingParams(max_new_tokens=4, ignore_eos=True),
        SpecConfig(method="sd", draft="tiny-draft", k=2),
    )
    assert len(res.outputs[0]["token_ids"]) == 4 and res.metrics["draft"]
    # a shipped name this install lacks: one line that says what to do
    monkeypatch.setattr(dfmt, "checkpoint_roots", lambda: [tmp_path / "none"])
    with pytest.raises(UserError, match="SSD_JAX_CHECKPOINTS") as e:
        load_model("smollm2-135m-draft")
    assert "\n" not in str(e.value)


def test_training_prompts_never_meet_benchmark_prompts():
    from ssd_jax.bench.protocol import category_prompts
    from ssd_jax.data import BENCH_RESERVE, prompt_heldout, training_prompts

    train = training_prompts()
    ids = {r["id"] for r in train}
    texts = {r["prompt"].strip() for r in train}
    assert len(ids) == len(train) > 1000
    assert all(not prompt_heldout(i) for i in ids)
    for cat in ("code", "chat", "math", "copy"):
        bench = category_prompts(cat, BENCH_RESERVE)
        bench_ids = {("humaneval/" + r["id"].split("/")[1]) if cat == "copy" else r["id"] for r in bench}
        assert not ids & bench_ids, cat
        if cat != "copy":
            assert not texts & {r["prompt"].strip() for r in bench}, cat
    assert {r["source"] for r in train[:8]} == {"humaneval", "mtbench", "sharegpt", "champ"}
    assert training_prompts(n=20) == train[:20]


@pytest.mark.realmodel
def test_shipped_draft_loads_by_name_from_another_directory(tmp_path, monkeypatch):
    from ssd_jax.drafters import default_draft

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(dfmt.CHECKPOINTS_ENV, raising=False)
    assert default_draft("smollm2-135m-instruct", "ssd") == "smollm2-135m-draft"
    assert (
        default_draft("smollm2-135m-instruct", "sd") == "smollm2-135m-eagle"
    )  # SD's default: the shipped head
    d = load_model("smollm2-135m-draft")
    assert d.cfg.num_layers == 3 and d.tokenizer is not None
