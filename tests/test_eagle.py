"""EAGLE-style draft heads (ssd_jax/drafters/eagle.py) on tiny models: the training view (every
position and draft step at once, under the decode-time mask) equals the decode-time drafting, and
training lowers the loss and raises the greedy acceptance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sd import tiny_model

from ssd_jax.compile import fresh_programs
from ssd_jax.drafters import eagle
from ssd_jax.models import llama


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, layers=4)


@pytest.mark.parametrize("trimmed", [False, True])
def test_training_view_equals_decode_time_drafting(target, trimmed):
    """For one sequence, the head's step-d log-probabilities at position j from the unrolled training
    view equal those of drafting after a prefill of pairs 0..j-1, pending pair j, own outputs fed back
    (the drafted tokens forced to the sequence's own, so both views see the same tokens). Trimmed: the
    training view's N columns are the decode-time row at the kept ids, and the row is -inf elsewhere."""
    cfg, tp = target.cfg, target.params
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    head = eagle.init_head(cfg, spec, seed=3, scale=0.2)
    T, K, j = 14, 3, 6
    toks = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (1, T)), jnp.int32)
    ids = None
    if trimmed:  # the sequence's own tokens among the kept ones, so the forced draws are proposable
        ids = jnp.asarray(np.union1d(np.arange(0, cfg.vocab_size, 3), np.asarray(toks[0])), jnp.int32)
    # jitted: op by op, every primitive would compile on its own (most of this test's time)
    feats, _ = jax.jit(eagle.target_features, static_argnums=(1, 3))(tp, cfg, toks, spec.layers)
    unrolled = jax.jit(eagle.unrolled_logits, static_argnums=(2, 5))(head, tp, cfg, toks, feats, K, ids)
    if trimmed:
        head = eagle.attach_vocab({**head, "vocab_ids": ids}, tp, cfg)

    cache = eagle.init_head_cache(cfg, 1, 64)
    fwd = jax.jit(eagle.head_forward, static_argnums=2, static_argnames="own")
    _, _, cache = fwd(head, tp, cfg, toks[:, 1 : j + 1], feats[:, :j], cache, own=False)
    cache = cache.with_lengths(cache.lengths + j)  # pairs 0..j-1 committed

    def forced(key, lg, d):  # the sequence's own token, and the head's log-probabilities as "q"
        return toks[:, j + 2 + d], jax.nn.log_softmax(lg, axis=-1)

    pend_tok = toks[:, j + 1 : j + 2]
    pend_feat = feats[:, j : j + 1]
    draft = jax.jit(eagle.head_draft, static_argnums=7, static_argnames=("cfg", "vocab"))
    _, q, cache = draft(
        head, tp, cache, pend_tok, pend_feat, jnp.ones(1, jnp.int32), jax.random.split(jax.random.key(0), K),
        forced, cfg=cfg, vocab=cfg.vocab_size,
    )  # fmt: skip
    assert int(cache.lengths[0]) == j + 1
    for d in range(K):
        row = np.asarray(q[0, d])
        if trimmed:
            out = np.setdiff1d(np.arange(cfg.vocab_size), np.asarray(ids))
            assert np.isneginf(row[out]).all()
            row = row[np.asarray(ids)]
        np.testing.assert_allclose(row, np.asarray(unrolled[d][0, j]), atol=2e-4)


def test_capture_returns_the_layers_outputs(target):
    cfg, tp = target.cfg, target.params
    toks = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
    h, _, f = llama.forward(tp, cfg, toks, llama.init_cache(cfg, 1, 8), capture=(cfg.num_layers - 1,))
    h2, _ = llama.forward(tp, cfg, toks, llama.init_cache(cfg, 1, 8))
    np.testing.assert_allclose(np.asarray(h), np.asarray(h2), atol=1e-6)
    # the last layer's output, normed, is the final hidden state
    np.testing.assert_allclose(
        np.asarray(llama.rms_norm(f, tp["final_norm"], cfg.rms_norm_eps)), np.asarray(h), atol=1e-5
    )


# slow (default-suite budget): the exactness tests below train a head too
@pytest.mark.slow
def test_training_lowers_the_loss_and_raises_acceptance(target, tmp_path):
    """Adam on the target's own greedy continuations of random prompts: the KL falls and the head's
    teacher-forced greedy acceptance (K = 3) rises well above the untrained head's. SD with the trained
    head through the engine then accepts too (the decode path feeds the head what training did) and
    still equals AR."""
    import optax

    from ssd_jax import SamplingParams, generate

    cfg, tp = target.cfg, target.params
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, cfg.vocab_size, 6).tolist() for _ in range(16)]
    res = generate(target, prompts, SamplingParams(max_new_tokens=26, ignore_eos=True))
    seqs = np.array([p + o["token_ids"] for p, o in zip(prompts, res.outputs)], np.int32)
    mask = np.zeros(seqs.shape, np.float32)
    mask[:, 5:-1] = 1.0  # token j + 1 is generated for j >= 5
    toks, mask = jnp.asarray(seqs), jnp.asarray(mask)

    head = eagle.init_head(cfg, spec, seed=0)
    opt = optax.adam(3e-3)
    step = eagle.make_head_step(cfg, spec, 2, opt)

    def accept(h):
        ok, w = eagle.greedy_acceptance(h, tp, toks, mask, cfg=cfg, spec=spec, k=3)
        return float((ok * w).sum() / w.sum())

    before = accept(head)
    state = opt.init(head)
    losses = []
    for _ in range(60):
        head, state, loss, _ = step(head, state, tp, toks, mask)
        losses.append(float(loss))
    after = accept(head)
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert after > max(0.8, before + 0.7), (before, after)  # mean accepted of K = 3 per scored position
    from ssd_jax import SpecConfig

    sd = generate(
        target, prompts[:4], SamplingParams(max_new_tokens=26, ignore_eos=True),
        spec=SpecConfig(method="sd", draft=_saved_head(tmp_path, target, head, spec), k=3),
    )  # fmt: skip
    assert [o["token_ids"] for o in sd.outputs] == [o["token_ids"] for o in res.outputs[:4]]
    assert sd.metrics["acceptance_rate"] > 0.25, sd.metrics["acceptance_rate"]


def _saved_head(tmp_path, target, head, spec, vocab_ids=None, name="head", **extra):
    from ssd_jax.training.eagle_train import save_head

    path = tmp_path / f"{name}.safetensors"
    meta = {
        "layers": list(spec.layers),
        "target_sha256": target.weights_sha256,
        "target": target.name,
        **extra,
    }
    save_head(path, head, meta, vocab_ids=vocab_ids)
    return f"eagle:{path}"


def test_sd_with_a_head_is_exact(target, tmp_path):
    """SD with an EAGLE head through the engine (batches, buckets): greedy equals AR token for token,
    with a random head and with the target's own output as the head's (a head that copies the target's
    last-layer features accepts everything: the control that the features reach the head right)."""
    from ssd_jax import SamplingParams, SpecConfig, generate

    cfg = target.cfg
    L = cfg.num_layers
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ar = [o["token_ids"] for o in generate(target, prompts, sp).outputs]
    spec = eagle.HeadSpec(eagle.default_layers(L))
    rand = _saved_head(tmp_path, target, eagle.init_head(cfg, spec, seed=5, scale=0.2), spec)
    res = generate(target, prompts, sp, spec=SpecConfig(method="sd", draft=rand, k=3))
    assert [o["token_ids"] for o in res.outputs] == ar
    assert res.metrics["draft"] == rand
    # a head with a trimmed vocabulary that leaves out some of AR's tokens: still AR's output
    kept = np.setdiff1d(
        np.arange(cfg.vocab_size), np.unique(np.concatenate([np.asarray(a) for a in ar]))[::2]
    )
    trim = _saved_head(tmp_path, target, eagle.init_head(cfg, spec, seed=5, scale=0.2), spec, kept, "trim")
    loaded, _ = eagle.load_head(trim[len("eagle:") :])
    np.testing.assert_array_equal(np.asarray(loaded["vocab_ids"]), kept)
    res = generate(target, prompts, sp, spec=SpecConfig(method="sd", draft=trim, k=3))
    assert [o["token_ids"] for o in res.outputs] == ar


def _trained_head(target, prompts, steps=60, seed=0):
    """A head trained briefly on the target's own T = 1 continuations of ``prompts`` (8 each), so that it
    partly agrees with the target there."""
    import optax

    from ssd_jax import SamplingParams, generate

    cfg = target.cfg
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    res = generate(
        target, prompts, SamplingParams(temperature=1.0, n=8, seed=seed, max_new_tokens=28, ignore_eos=True)
    )
    seqs = [prompts[i // 8] + o["token_ids"] for i, o in enumerate(res.outputs)]
    T = max(map(len, seqs))
    toks, mask = np.zeros((len(seqs), T), np.int32), np.zeros((len(seqs), T), np.float32)
    for i, q in enumerate(seqs):
        toks[i, : len(q)] = q
        mask[i, len(prompts[i // 8]) - 1 : len(q) - 1] = 1.0  # token j + 1 generated
    head, opt = eagle.init_head(cfg, spec, seed=seed), optax.adam(1e-2)
    state, step = opt.init(head), eagle.make_head_step(cfg, spec, 2, opt)
    for _ in range(steps):
        head, state, _, _ = step(head, state, target.params, jnp.asarray(toks), jnp.asarray(mask))
    return head, spec


def sampled_with_head(tmp_path, monkeypatch, method, biased, kept=None):
    """(result, goodness-of-fit report) of ``method`` with a briefly trained head at T = 1 over
    test_exactness's prompts, rows and K; ``biased``: the verifier draws the bonus token from the draft's
    q (the control); ``kept``: the head's LM head trimmed to those ids."""
    import dataclasses

    from reference import collect, goodness_of_fit
    from test_exactness import K, N_ROWS, NEW_TOKENS, STAT_PROMPTS, T1, _bonus_from_q

    from ssd_jax import SpecConfig, generate

    target = tiny_model(7, vocab=16, scale=0.3, layers=2)
    head, spec = _trained_head(target, STAT_PROMPTS)
    draft = _saved_head(tmp_path, target, head, spec, kept)
    if biased:
        _bonus_from_q(monkeypatch)
    try:
        with fresh_programs():  # a biased run's programs are its own, dropped after
            sp = dataclasses.replace(T1, n=N_ROWS, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=31)
            res = generate(target, STAT_PROMPTS, sp, SpecConfig(method=method, draft=draft, k=K))
    finally:
        monkeypatch.undo()
    rep = goodness_of_fit(collect(target, STAT_PROMPTS, res.outputs, K, sp), seed=31)
    assert rep.n == len(STAT_PROMPTS) * N_ROWS * NEW_TOKENS
    return res, rep


@pytest.mark.parametrize(
    "case",
    ["full", pytest.param("biased", marks=pytest.mark.slow), pytest.param("trimmed", marks=pytest.mark.slow)],
)
def test_sampled_sd_with_a_head_follows_the_target(tmp_path, monkeypatch, case):
    """Every token SD emits with an EAGLE head at T = 1 is scored against the target's conditional
    (the goodness-of-fit test of test_exactness, same prompts, rows and K), also with the head's LM head
    trimmed to 8 of the 16 tokens (q = 0 on the rest: the residual must give them their mass); a
    verifier that draws the bonus token from the head's q (the control) must fail it."""
    biased = case == "biased"
    kept = np.arange(0, 16, 2) if case == "trimmed" else None
    res, rep = sampled_with_head(tmp_path, monkeypatch, "sd", biased, kept)
    if biased:
        assert rep.rejected, f"the biased engine passed: {rep}"
        return
    assert not rep.rejected, str(rep)
    if kept is not None:  # the head never proposes the other 8 tokens, yet they are emitted (by the residual)
        toks = np.concatenate([np.asarray(o["token_ids"]) for o in res.outputs])
        assert np.isin(toks, kept, invert=True).mean() > 0.2
        return
    # accepted / drafted: at about 0.4 a position (the head generalises a little) 0.15-0.2 of K = 4
    assert 0.1 < res.metrics["acceptance_rate"] < 0.95, res.metrics["acceptance_rate"]


def test_heads_by_name_and_one_line_errors(target, tmp_path, monkeypatch):
    """A head is found as ``eagle:PATH``, as a directory holding ``head.safetensors`` or by name in the
    checkpoint roots; what a head cannot do is refused in one line (UserError)."""
    from ssd_jax import SpecConfig
    from ssd_jax.engine.methods.eagle import eagle_source, is_eagle, load_eagle
    from ssd_jax.planning import configure
    from ssd_jax.errors import UserError

    cfg = target.cfg
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    root = tmp_path / "roots"
    (root / "my-head").mkdir(parents=True)
    _saved_head(root / "my-head", target, eagle.init_head(cfg, spec), spec)
    monkeypatch.setenv("SSD_JAX_CHECKPOINTS", str(root))
    assert eagle_source("my-head") == str(root / "my-head") == eagle_source("eagle:my-head")
    assert eagle_source(str(root / "my-head")) == str(root / "my-head")
    assert not is_eagle("smollm2-135m-draft") and not is_eagle("ngram") and not is_eagle(None)
    head, meta = load_eagle(target, "my-head")
    assert meta["layers"] == list(spec.layers)
    assert (
        configure(target, SpecConfig(method="sd", draft="my-head", k="auto"), rows=1, load=None)[0].k == 4
    )  # no curve stored
    for bad in (
        SpecConfig(method="ssd", draft="my-head", k=2, backup="ngram"),
        SpecConfig(method="ar", draft="my-head", k=2),
        SpecConfig(method="sd", draft="my-head", k=2, draft_vocab=16),
        SpecConfig(method="sd", draft="my-head", k=2, draft_dtype="bfloat16"),
    ):
        with pytest.raises(UserError):
            configure(target, bad, rows=1, load=None)
    with pytest.raises(UserError, match="no EAGLE head"):
        load_eagle(target, "eagle:does-not-exist")
    other = tiny_model(1, layers=4)
    with pytest.raises(UserError, match="another target"):
        load_eagle(other, "my-head")


def test_k_auto_for_a_head_follows_its_acceptance_curve(target, tmp_path, monkeypatch):
    """S(K) = (1 + sum P_d) t_ar / (K t_head + t_verify(K + 1)) from the head's stored curve: a head that
    keeps being accepted gets a larger K than one whose fed-back proposals fail."""
    from ssd_jax.planning import head_model
    from ssd_jax.planning.head_model import choose_head_k, head_curve, head_speedups
    from ssd_jax.planning.records import Calibration, Costs

    assert head_curve([0.8, 0.4], 4) == pytest.approx([0.8, 0.4, 0.2, 0.1])
    tv = {k: 1.0 + 0.1 * k for k in range(1, 9)}
    sp = head_speedups([0.5, 0.25], 1.0, tv, 0.05)
    assert sp[2] == pytest.approx((1 + 0.5 + 0.25) / (2 * 0.05 + 1.2))
    monkeypatch.setenv("SSD_JAX_KAUTO_CACHE", str(tmp_path))
    cfg = target.cfg
    head = eagle.init_head(cfg, eagle.HeadSpec(eagle.default_layers(cfg.num_layers)))
    _, info = choose_head_k(target, head, {"acceptance_by_position": [0.5]}, 1)
    _, again = choose_head_k(target, head, {"acceptance_by_position": [0.5]}, 1)
    assert info["source"] == "measured" and again["source"] == "cache"  # the target's costs, timed once
    # the choice itself on fixed costs (a tiny model's timings are noise on a busy machine)
    fixed = Calibration(
        0.0, "none", Costs(1.0, {1: 1.1, 4: 1.3, 8: 1.6}), source="cache", path=tmp_path / "f"
    )
    monkeypatch.setattr(head_model.Calibrator, "target_costs", lambda self, batch: fixed)
    strong, info = choose_head_k(target, head, {"acceptance_by_position": [0.97, 0.95, 0.93, 0.9]}, 1)
    weak, info2 = choose_head_k(target, head, {"acceptance_by_position": [0.3, 0.03, 0.003, 0.0003]}, 1)
    assert strong > weak >= 1, (info["expected_speedup_by_k"], info2["expected_speedup_by_k"])


def test_k_auto_runs_ar_rounds_where_a_head_cannot_pay(target, tmp_path, monkeypatch):
    """Offline, K auto with a head (SD or SSD) whose best K is not predicted to beat AR by more than the
    planner's error runs the target's AR rounds (the head's K is fixed: no AR rounds of its own): greedy
    equals AR, the plan says why. An explicit K speculates whatever the costs; costs where the head pays:
    K auto speculates."""
    from ssd_jax import SamplingParams, SpecConfig, generate
    from ssd_jax.planning import head_model
    from ssd_jax.planning.records import Calibration, Costs

    cfg = target.cfg
    spec = eagle.HeadSpec(eagle.default_layers(cfg.num_layers))
    curve = [0.97, 0.95, 0.93, 0.9]
    draft = _saved_head(tmp_path, target, eagle.init_head(cfg, spec), spec, acceptance_by_position=curve)
    prompts, sp = [[3, 17, 29, 3, 17], [77]], SamplingParams(max_new_tokens=12, ignore_eos=True)
    ar = [o["token_ids"] for o in generate(target, prompts, sp).outputs]

    def priced(verify: float):  # the target's costs: a step 1 s, a verify of K + 1 tokens ``verify`` s
        fixed = Calibration(
            0.0, "none", Costs(1.0, {1: verify, 8: verify}), source="cache", path=tmp_path / "c"
        )
        monkeypatch.setattr(head_model.Calibrator, "target_costs", lambda self, batch: fixed)

    def drafted(res):
        return sum(o["metrics"]["drafted"] for o in res.outputs)

    priced(6.0)  # nothing pays
    for method in ("sd", "ssd"):
        res = generate(target, prompts, sp, SpecConfig(method=method, draft=draft))
        m, plan = res.metrics, res.metrics["plan"]
        assert [o["token_ids"] for o in res.outputs] == ar and res.method == method
        assert (
            plan["chosen"]["ar_rounds"] and plan["predicted"]["best_speculation"]["expected_speedup"] < 1.12
        )
        assert plan["line"].startswith(f"plan: {method} AR rounds: the best speculation (K=")
        assert m["k_rounds"] == {"0": m["verify_steps"]} and drafted(res) == 0
    given = generate(target, prompts, sp, SpecConfig(method="sd", draft=draft, k=2))
    assert [o["token_ids"] for o in given.outputs] == ar and drafted(given) > 0
    priced(1.0)  # a verify as cheap as a step: the head pays
    res = generate(target, prompts, sp, SpecConfig(method="sd", draft=draft))
    assert [o["token_ids"] for o in res.outputs] == ar and drafted(res) > 0
    assert "ar_rounds" not in res.metrics["plan"]["chosen"]


def test_scored_positions_weigh_prompts_and_skip_padding():
    """Position j's weight is that of token j + 1: 1 for a generated token, the prompt weight for a
    prompt token, 0 for padding (and for the window's last position, whose next token is not in it)."""
    from ssd_jax.training.eagle_train import scored_positions

    seg = np.array([[1, 1, 1, 1, 1, 0, 0, 0]], np.int32)  # 5 tokens, then padding
    mask = np.array([[0, 0, 1, 1, 0, 0, 0, 0]], np.float32)  # tokens 3 and 4 are generated
    w = scored_positions({"segments": seg, "mask": mask}, 0.25)
    np.testing.assert_allclose(w[0], [0.25, 0.25, 1, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(scored_positions({"segments": seg, "mask": mask}, 0.0)[0], mask[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    "target_name,head_name,floor",
    [
        ("smollm2-135m-instruct", "smollm2-135m-eagle", 0.3),
        ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-eagle", 0.3),
    ],
)
def test_shipped_head_keeps_its_acceptance(target_name, head_name, floor):
    """Regression guard on the shipped heads: the teacher-forced first-proposal acceptance on held-out
    benchmark prompts (code and chat, chat template, the target's greedy answers) stays >= ``floor``."""
    from ssd_jax import load_model
    from ssd_jax.engine.methods.eagle import load_eagle
    from ssd_jax.training.eagle_train import evaluate_head, held_out_sequences

    target = load_model(target_name, dtype="float32")
    head, meta = load_eagle(target, head_name)
    toks, mask = held_out_sequences(target, 4, 32)
    ev = evaluate_head(head, target, eagle.HeadSpec(tuple(meta["layers"])), toks, mask, k=4)
    assert ev["alpha_1"] >= floor, ev


def test_evaluation_walks_rounds_where_sd_starts_them(monkeypatch):
    """``evaluate_head``'s tokens a round: rounds start after the prefill's token and then after each
    round's last token (not at every position), reading the teacher-forced accepted counts."""
    import types

    from ssd_jax.drafters import eagle as eagle_mod
    from ssd_jax.training.eagle_train import evaluate_head

    ok = np.asarray([[1, 0, 2, 0, 0, 3, 0, 1, 0]])
    w = np.asarray([[0, 1, 1, 1, 1, 1, 1, 1, 0]], bool)
    monkeypatch.setattr(eagle_mod, "greedy_acceptance", lambda *a, **k: (ok, w))
    target = types.SimpleNamespace(params=None, cfg=None)
    ev = evaluate_head({}, target, None, np.zeros((1, 9)), np.zeros((1, 9)), k=4, batch=1, ids=None)
    # scored from index 1; rounds at 2 (2 accepted: 3 tokens), 5 (3: 4 tokens), 9 (past the end)
    assert (ev["tokens_per_round"], ev["rounds"]) == (3.5, 2)
    assert ev["alpha_1"] == pytest.approx(3 / 7)  # positions 1..7: 0, 2, 0, 0, 3, 0, 1
