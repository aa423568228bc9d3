"""``k="auto"`` / ``--k auto``: the K choice from α and costs, the on-disk calibration cache, exactness
with the chosen K, the ``k`` / ``k_auto`` metrics and the CLI flag (tiny random models)."""

import json

import numpy as np
import pytest
from test_sd import PROMPTS, _ids

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.decoding.spec import K_MAX
from ssd_jax.planning.policy import KPlan, OnlineK
from ssd_jax.planning.sd_model import best_k, expected_speedups, interpolate_verify
from ssd_jax.errors import UserError

SP = SamplingParams(max_new_tokens=20, ignore_eos=True)


def test_best_k_on_known_optima():
    flat = {k: 1.0 for k in range(1, K_MAX + 1)}  # verify as cheap as a step (GPU-like)
    # α = 0.8, draft step 0.1 of a target step: S(K) = E(K) / (1 + 0.1 K) peaks at K = 6 (2.470 vs 2.459, 2.448)
    sp = expected_speedups(0.8, 1.0, flat, t_draft_step=0.1)
    assert best_k(sp) == 6
    assert sp[6] == pytest.approx((1 - 0.8**7) / 0.2 / 1.6)
    assert best_k(expected_speedups(0.9, 1.0, flat)) == K_MAX  # free draft: more is better
    assert best_k(expected_speedups(0.0, 1.0, flat, t_draft_step=0.1)) == 1  # nothing is ever accepted
    assert best_k(expected_speedups(1.0, 1.0, flat, c_round=0.5)) == K_MAX
    # a verify that grows with K caps it: t_v(K+1) = 1 + 0.25 K, free draft, α = 0.8:
    # S = 1.44, 1.627, 1.687, 1.681 for K = 1..4 -> K = 3
    grow = {k: 1 + 0.25 * k for k in range(1, K_MAX + 1)}
    sp = expected_speedups(0.8, 1.0, grow)
    assert best_k(sp) == max(sp, key=sp.get) == 3
    assert best_k({1: 2.0, 2: 2.0, 3: 1.0}) == 1  # ties: the smaller K
    assert interpolate_verify({1: 1.0, 4: 4.0, 8: 4.0}) == {
        1: 1.0,
        2: 2.0,
        3: 3.0,
        4: 4.0,
        5: 4.0,
        6: 4.0,
        7: 4.0,
        8: 4.0,
    }


def test_spec_validation_of_k():
    SpecConfig(method="sd", draft="ngram").validate()  # default: auto
    assert SpecConfig().k == "auto"
    for bad in (0, -1, "abc", 2.5, True):
        with pytest.raises(UserError, match="k must be"):
            SpecConfig(method="sd", draft="ngram", k=bad).validate()
    with pytest.raises(UserError, match="fixes k"):  # a uniform fan-out's budget decides K: no calibration
        SpecConfig(method="ssd", draft="x", fan_out=2, fan_out_budget=6).validate()
    SpecConfig(method="ssd", draft="x", fan_out=2, fan_out_budget=6, k=2).validate()


@pytest.mark.slow  # default-suite budget (15 min on 2 cores): test_cli_k_auto covers K auto end to end
def test_auto_k_metrics_and_greedy_equality(pair, ar_ref):
    target, draft = pair
    for d in (draft, "ngram"):
        res = generate(target, PROMPTS, SP, SpecConfig(method="sd", draft=d))
        m = res.metrics
        assert isinstance(m["k"], int) and 1 <= m["k"] <= K_MAX
        ka = m["k_auto"]
        assert ka["source"] in ("measured", "cache") and 0.0 <= ka["alpha"] <= 1.0
        assert set(ka["costs"]) == {"t_ar", "t_verify", "t_draft_step", "c_round"}
        sp = {int(k): v for k, v in ka["expected_speedup_by_k"].items()}
        assert sorted(sp) == list(range(1, K_MAX + 1)) and best_k(sp) == m["k"]
        assert m["compile_s"] >= ka["calibration_s"]
        assert _ids(res) == ar_ref, d
    ssd = generate(target, PROMPTS, SP, SpecConfig(method="ssd", draft=draft))
    # SD's record of the pair lacks what SSD's round model needs (the draft's step at several row counts,
    # its build timed whole): SSD measures again (planning/records.py, Calibrator.record), then reuses it
    ka = ssd.metrics["k_auto"]
    assert ka["source"] == "measured" and {"t_draft_rows", "t_build"} <= set(ka["costs"])
    assert _ids(ssd) == ar_ref
    # an explicit k is used as given (here auto's own choice: the same compiled round, the same tokens)
    fixed = generate(target, PROMPTS, SP, SpecConfig(method="sd", draft="ngram", k=res.metrics["k"]))
    assert (
        fixed.metrics["k_auto"] is None and fixed.metrics["k"] == res.metrics["k"] and _ids(fixed) == ar_ref
    )
    assert generate(target, PROMPTS, SP).metrics.get("k_auto") is None  # AR ignores k


def test_cache_reuse_gives_the_same_k_and_tokens(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_JAX_KAUTO_CACHE", str(tmp_path))
    target, draft = pair
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=1.0, seed=3)
    spec = SpecConfig(method="sd", draft=draft)
    a = generate(target, PROMPTS, sp, spec)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and a.metrics["k_auto"]["source"] == "measured"
    assert not list(tmp_path.glob(".*tmp"))  # the atomic write left no temporary file
    b = generate(target, PROMPTS, sp, spec)
    assert b.metrics["k_auto"]["source"] == "cache" and b.metrics["k_auto"]["calibration_s"] == 0.0
    assert b.metrics["k"] == a.metrics["k"] and _ids(b) == _ids(a)
    assert b.metrics["k_auto"]["costs"] == a.metrics["k_auto"]["costs"]
    # the K comes from the stored numbers: make K = 5 the optimum and it is used
    rec = json.loads(files[0].read_text())
    assert rec["batch"] == len(PROMPTS) and rec["alpha"] == a.metrics["k_auto"]["alpha"]
    rec["alpha"] = 0.9
    rec["costs"].update(
        t_ar=1.0, t_draft_step=0.05, c_round=0.0, t_verify={"1": 1.0, "2": 1.0, "4": 1.0, "8": 2.0}
    )
    files[0].write_text(json.dumps(rec))
    c = generate(target, PROMPTS, sp, spec)
    assert (
        c.metrics["k"]
        == 4
        == best_k(
            expected_speedups(
                0.9, 1.0, interpolate_verify({1: 1.0, 2: 1.0, 4: 1.0, 8: 2.0}), t_draft_step=0.05
            )
        )
    )
    assert c.metrics["k_adaptive"] and c.metrics["k_auto"]["adaptive"]  # SD then re-chooses K every round
    assert (
        set(c.metrics["k_rounds"]) <= {"1", "2", "4", "8"}
        and sum(c.metrics["k_rounds"].values()) == c.metrics["verify_steps"]
    )
    # up to the largest K the plan can choose at some acceptance (only those are compiled)
    plan = KPlan.from_costs(c.metrics["k_auto"]["alpha"], rec["costs"], c.metrics["k"])
    reachable = {plan.choose(a) for a in np.linspace(0.0, 1.0, 101)} | {c.metrics["k"]}
    assert len(c.metrics["acceptance_histogram"]) == max(reachable) + 1
    assert {int(k) for k in c.metrics["k_rounds"]} <= reachable
    # a forced re-calibration measures again
    monkeypatch.setenv("SSD_JAX_KAUTO_RECALIBRATE", "1")
    assert generate(target, PROMPTS, sp, spec).metrics["k_auto"]["source"] == "measured"
    monkeypatch.delenv("SSD_JAX_KAUTO_RECALIBRATE")
    files[0].write_text('{"format": 1, "cos')  # a torn file is never trusted: measured again
    assert generate(target, PROMPTS, sp, spec).metrics["k_auto"]["source"] == "measured"
    assert json.loads(files[0].read_text())["alpha"] == a.metrics["k_auto"]["alpha"]


def test_cli_k_auto(tiny_llama_path, capsys):
    from ssd_jax.cli.decode import main

    common = [
        "--target",
        tiny_llama_path,
        "--prompt-ids",
        "1,2,3,1,2,3",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--json",
    ]
    assert main([*common, "--method", "sd", "--draft", "ngram"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert isinstance(d["metrics"]["k"], int) and d["metrics"]["k_auto"]["source"] in ("measured", "cache")
    assert main([*common, "--method", "sd", "--draft", "ngram", "--k", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["k_auto"]["source"] == "cache"
    assert main([*common, "--method", "ar", "--k", "auto"]) == 0  # ignored by AR
    assert json.loads(capsys.readouterr().out)["method"] == "ar"


def test_random_drafter_alpha_is_exact_and_a_draft_equal_to_the_target_accepts_everything(pair):
    """Calibration only (no decoding): α = 1/V for uniform proposals, α = 1 when draft = target."""
    from ssd_jax.planning.calibration import calibrate

    target, _ = pair
    rec = calibrate(target, SpecConfig(method="sd", draft="random"), None, len(PROMPTS), 128)
    assert rec["alpha"] == 1 / 128 and rec["alpha_source"] == "exact"
    assert rec["costs"]["t_draft_step"] == 0.0 and all(v > 0 for v in rec["costs"]["t_verify"].values())
    rec = calibrate(target, SpecConfig(method="sd", draft=target), target, len(PROMPTS), 128)
    assert rec["alpha"] == 1.0 and rec["costs"]["t_draft_step"] > 0


# verify as cheap as a decode step, a draft step 0.05 of one: K = 8 pays at α = 1, K = 4 at 0.6, K = 1 at 0.1
COSTS = {"t_ar": 1.0, "t_verify": {"1": 1.0, "8": 1.0}, "t_draft_step": 0.05, "c_round": 0.0}


def test_online_k_follows_the_runs_acceptance():
    plan = KPlan.from_costs(1.0, COSTS, k0=8)
    assert plan.ks == (1, 2, 4, 8) and KPlan.from_costs(1.0, COSTS, k0=3).ks == (1, 2, 3, 4, 8)
    assert plan.choose(1.0) == 8 and plan.choose(0.6) == 4 and plan.choose(0.1) == 1
    on = OnlineK(plan)
    live = np.array([True, True, False])
    # row 0 accepts 2 of 8 (a rejection), row 1 all 8 (no rejection: censored), row 2 has stopped (ignored)
    on.update(8, live, np.array([2, 8, 0]), np.array([8, 8, 8]))
    assert (on.accepted, on.rejections) == (10, 1)
    assert on.alpha == pytest.approx((10 + 8 * 1.0) / (10 + 1 + 8)) and on.k == plan.choose(on.alpha) == 8
    on.update(8, live, np.array([0, 3, 5]), np.array([0, 8, 8]))  # row 0 proposed nothing: no evidence
    assert (on.accepted, on.rejections) == (13, 2)
    for _ in range(40):  # nothing accepted any more: K falls to 1
        on.update(on.k, live, np.zeros(3, int), np.full(3, on.k))
    assert on.k == 1 and on.alpha < 0.25
    m = on.metrics()
    assert m["k_adaptive"] and m["k_candidates"] == [1, 2, 4, 8] and sum(m["k_rounds"].values()) == 42
    assert m["k_rounds"]["8"] >= 2 and "1" in m["k_rounds"]
    assert m["k_mean"] == pytest.approx(sum(int(k) * c for k, c in m["k_rounds"].items()) / 42)
    # the caches hold the largest K the run may switch to, not the first round's
    assert SpecConfig(method="sd", draft="ngram", k=1, k_plan=plan).extra_cache_slots == 8 + 1
    with pytest.raises(UserError, match="k_plan"):
        SpecConfig(method="sd", draft="ngram", k_plan={"alpha": 1.0}).validate()


def test_k_zero_and_a_plan_per_batch_bucket():
    """K = 0 (an AR round) is chosen exactly where no K is expected to beat AR; one plan per batch bucket
    chooses by the running rows' bucket; the lookup table agrees with the exact choice."""
    from ssd_jax.planning.policy import BucketPlans

    # at one row verifying is as cheap as a step; at 8 rows a verify of K + 1 tokens costs 1.7 (K = 1) to 6
    # (K = 8) steps
    one = KPlan.from_costs(0.6, COSTS, k0=4, zero=True)
    eight_costs = {**COSTS, "t_verify": {"1": 1.7, "8": 6.0}}
    eight = KPlan.from_costs(0.6, eight_costs, k0=1, zero=True)
    assert one.choose(0.6) == 4 and eight.choose(0.6) == 0 and eight.speedup(0.6, 0) == 1.0
    assert max(eight.speedup(0.6, k) for k in eight.ks) < 1.0 < one.speedup(0.6, 4)
    # without K = 0 the plan keeps its least bad K; with it, K = 0 only below S(K) = 1
    assert KPlan.from_costs(0.6, eight_costs, k0=1).choose(0.6) == 1
    assert eight.choose(1.0) == 8 and eight.speedup(1.0, 8) > 1.0
    for a in (0.0, 0.3, 0.6, 0.95, 1.0):
        assert one.k_for(None, a) == one.choose(a) and eight.k_for(8, a) == eight.choose(a)
    plans = BucketPlans(((1, one), (2, one), (8, eight)))
    assert [plans.k_for(b, 0.6) for b in (1, 2, 3, 8, None)] == [4, 4, 0, 0, 0]
    assert plans.ks == (1, 2, 4, 8) and plans.zero and plans.alpha == 0.6
    assert plans.summary().startswith("1: K=4 ") and plans.summary().endswith("8: K=0 (AR)")
    on = OnlineK(plans)
    assert (on.k_for(1), on.k_for(8)) == (4, 0)
    # K = 0 proposes nothing: every EXPLORE_EVERY-th K = 0 round in a row speculates at the best K > 0 instead
    from ssd_jax.planning.policy import EXPLORE_EVERY

    ks = [on.k_for(8) for _ in range(2 * EXPLORE_EVERY)]
    assert ks.count(0) == 2 * EXPLORE_EVERY - 2 and ks[EXPLORE_EVERY - 2] == eight.positive_table[600] == 1
    assert on.metrics()["k_explore_rounds"] == 2 and plans.ks_at(None) == {
        0,
        *on.plan.plan(1).table.tolist(),
        1,
    }
    for _ in range(30):  # every proposal accepted: speculation pays at 8 rows too
        on.update(4, np.array([True]), np.array([4]), np.array([4]))
    assert on.k_for(8) > 0 and on.k_for(1) == 8
    assert SpecConfig(method="sd", draft="ngram", k=1, k_plan=plans).extra_cache_slots == 8 + 1


@pytest.mark.parametrize("drafter", ["unrelated", "ngram", "target"])
def test_adaptive_k_greedy_equals_ar(pair, ar_ref, drafter):
    """K re-chosen every round: greedy output still equals AR. An unrelated draft starts at K = 8 and
    falls; the target as its own draft (everything accepted, a catch-up every round) starts at K = 1
    and rises."""
    target, draft = pair
    d = {"unrelated": draft, "ngram": "ngram", "target": target}[drafter]
    prior = 0.0 if drafter == "target" else 1.0
    spec = SpecConfig(
        method="sd",
        draft=d,
        k=KPlan.from_costs(prior, COSTS, 8).choose(prior),
        k_plan=KPlan.from_costs(prior, COSTS, 8),
    )
    res = generate(target, PROMPTS, SP, spec)
    m = res.metrics
    assert _ids(res) == ar_ref
    assert m["k_adaptive"] and sum(m["k_rounds"].values()) == m["verify_steps"]
    if drafter == "unrelated":
        assert m["k_rounds"].get("8", 0) >= 1 and min(map(int, m["k_rounds"])) < 8, m["k_rounds"]
    if drafter == "target":
        assert m["k"] == 1 and m["k_rounds"].get("1", 0) >= 1 and max(map(int, m["k_rounds"])) >= 4, m[
            "k_rounds"
        ]
        assert m["acceptance_rate"] > 0.9


def test_adaptive_k_seeded_runs_repeat(pair):
    """K depends only on earlier rounds' outcomes, so the same seed gives the same tokens and the same Ks."""
    target, draft = pair
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=1.0, seed=11)
    spec = SpecConfig(method="sd", draft=draft, k=8, k_plan=KPlan.from_costs(1.0, COSTS, 8))
    a, b = generate(target, PROMPTS, sp, spec), generate(target, PROMPTS, sp, spec)
    assert _ids(a) == _ids(b) and a.metrics["k_rounds"] == b.metrics["k_rounds"]


def test_a_server_speculates_only_beyond_the_models_error():
    """With a margin (a server: SERVING_MARGIN, the planner's measured prediction error) a bucket runs AR
    rounds where the predicted gain is positive but inside the margin, and speculates beyond it; SSD's
    per-bucket switch applies the same margin to its timed rounds."""
    from ssd_jax.planning.policy import SERVING_MARGIN, BucketSwitch

    # 4 rows: a verify of K + 1 tokens costs 1.45 (K = 1) to 5 (K = 8) steps; α 0.6: K = 1 gains ~7%
    costs = {**COSTS, "t_verify": {"1": 1.45, "8": 5.0}}
    bare = KPlan.from_costs(0.6, costs, k0=1, zero=True)
    kept = KPlan.from_costs(0.6, costs, k0=1, zero=True, margin=SERVING_MARGIN)
    best = max(bare.speedup(0.6, k) for k in bare.ks)
    assert 1.0 < best < 1.0 + SERVING_MARGIN
    assert bare.choose(0.6) > 0 and kept.choose(0.6) == 0
    assert kept.choose(1.0) > 0 and kept.speedup(1.0, kept.choose(1.0)) > 1.0 + SERVING_MARGIN
    assert kept.explore_k(None, 0.6) == bare.choose(0.6)  # exploring rounds still try the best K > 0
    switch = BucketSwitch(3, 2.0, 0.6, margin=0.12)
    assert switch.speculates(4, t_round=1.7, t_ar=1.0) and not switch.speculates(4, t_round=1.9, t_ar=1.0)
    assert BucketSwitch(3, 2.0, 0.6).speculates(4, t_round=1.9, t_ar=1.0)


def _priced(monkeypatch, pays: bool):
    """A calibration double: each record as measured (SSD's simulated hits come from its ranks), its α and
    costs replaced, in seconds of a 1 s decode step (SSD's measured fixed cost a round, milliseconds, is then
    nothing). ``pays``: α 1, a verify as cheap as a step, a free draft; else α 0 and a verify of 5 steps, so
    that every configuration is priced below AR."""
    import dataclasses

    from ssd_jax.planning.records import Calibrator

    real = Calibrator.record

    def record(self, spec, draft, batch):
        cal = real(self, spec, draft, batch)
        c, verify = cal.costs, 1.0 if pays else 5.0
        rows = None if c.t_draft_rows is None else dict.fromkeys(c.t_draft_rows, 0.0)
        costs = dataclasses.replace(
            c, t_ar=1.0, t_verify=dict.fromkeys(c.t_verify, verify), t_draft_step=0.0, c_round=0.0,
            t_draft_rows=rows, t_build=None,
        )  # fmt: skip
        return dataclasses.replace(cal, alpha=1.0 if pays else 0.0, costs=costs)

    monkeypatch.setattr(Calibrator, "record", record)


def _drafted(res) -> int:
    return sum(o["metrics"]["drafted"] for o in res.outputs)


@pytest.mark.parametrize("method", ["sd", "ssd"])
def test_k_auto_runs_ar_rounds_where_nothing_pays(pair, ar_ref, monkeypatch, method):
    """Offline, K auto runs AR rounds where no configuration is predicted to beat AR by more than the
    planner's error (policy.SERVING_MARGIN): SD on one device through its K plan (K = 0 rounds, the draft
    idle), SSD through its switch with every bucket AR (the draft idle). Greedy output equals AR's, the
    plan says why, the metrics count rounds that proposed nothing. The control: costs where speculation
    pays (the target as SSD's own draft, so that its simulated tree hits), and it speculates; an explicit
    K speculates whatever the costs."""
    target, draft = pair
    backup = {"backup": "neural"} if method == "ssd" else {}
    _priced(monkeypatch, pays=False)
    res = generate(target, PROMPTS, SP, SpecConfig(method=method, draft=draft, **backup))
    m, plan = res.metrics, res.metrics["plan"]
    assert _ids(res) == ar_ref and res.method == method
    best = plan["predicted"]["best_speculation"]
    assert plan["chosen"]["ar_rounds"] and best["expected_speedup"] < 1.0 + plan["chosen"]["margin"]
    assert plan["predicted"]["expected_speedup"] == 1.0 and plan["choice"].startswith("AR rounds (predicted")
    assert plan["line"].startswith(f"plan: {method} AR rounds: the best speculation (K={best['k']}")
    assert f"is predicted at {best['expected_speedup']:.2f}x AR here" in plan["line"]
    assert m["k_rounds"]["0"] == m["verify_steps"] > 0 and _drafted(res) == 0
    assert m["acceptance_rate"] == 0.0 and m["mean_acceptance_length"] == 1.0
    if method == "ssd":
        assert m["ar_buckets"] == [len(PROMPTS)] and m["cache_hit_rate"] == 0.0 and "theorem7" not in plan
    given = generate(target, PROMPTS, SP, SpecConfig(method=method, draft=draft, k=2, **backup))
    assert (
        _ids(given) == ar_ref and _drafted(given) > 0 and "ar_rounds" not in given.metrics["plan"]["chosen"]
    )
    _priced(monkeypatch, pays=True)
    res = generate(
        target, PROMPTS, SP, SpecConfig(method=method, draft=target if method == "ssd" else draft, **backup)
    )
    plan = res.metrics["plan"]
    assert _ids(res) == ar_ref and _drafted(res) > 0 and "ar_rounds" not in plan["chosen"]
    assert plan["predicted"]["expected_speedup"] > 1.0 + plan["chosen"]["margin"]


def test_k_auto_where_k_is_fixed_runs_the_targets_ar_rounds(
    pair, ar_ref, monkeypatch, tiny_llama_path, capsys
):
    """A method whose K is fixed (here SD stage by stage) has no AR rounds of its own: where its plan
    declines, the run is the target's AR method under SD's name, with SD's metrics for rounds that propose
    nothing; the CLI's JSON keeps its contract and carries the plan."""
    from ssd_jax.cli.decode import main

    target, _ = pair
    _priced(monkeypatch, pays=False)
    res = generate(target, PROMPTS, SP, SpecConfig(method="sd", draft="ngram", profile_stages=True))
    m = res.metrics
    assert _ids(res) == ar_ref and res.method == "sd" and m["plan"]["chosen"]["ar_rounds"]
    assert m["k_rounds"] == {"0": m["verify_steps"]} and m["draft_s"] is None and _drafted(res) == 0
    assert (m["acceptance_rate"], m["mean_acceptance_length"], m["per_position_acceptance"]) == (0.0, 1.0, [])
    args = ["--target", tiny_llama_path, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6,7,8"]
    assert (
        main([*args, "--max-new-tokens", "6", "--ignore-eos", "--json", "--method", "sd", "--draft", "ngram"])
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    need = ["acceptance_rate", "mean_acceptance_length", "per_position_acceptance", "acceptance_histogram"]
    need += ["verify_steps", "draft_s", "verify_s", "sample_s", "overhead_s", "tokens_per_s", "wall_s"]
    assert d["method"] == "sd" and set(need) <= set(d["metrics"])
    assert d["metrics"]["plan"]["line"].startswith("plan: sd AR rounds: the best speculation")
