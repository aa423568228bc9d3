"""SSD's fixed cost a round and its miss path in the planner (:mod:`ssd_jax.planning.ssd_model`, issue 48):
the measured fixed cost enters every round (lowers the expected speedup, can move K), the neural and
fast backups are each priced and the faster chosen where the engine may choose, Theorem 7 against a
hand-computed case, and a run's metrics carrying the plan's prediction beside its bound and measurement."""

import numpy as np
import pytest
from test_sd import PROMPTS, _ids
from test_ssd_plan import _record

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.planning import ssd_model as plan
from ssd_jax.planning.records import Calibration, Costs

SP = SamplingParams(max_new_tokens=20, ignore_eos=True)


def test_the_fixed_cost_enters_every_round_and_can_move_k():
    rec = _record(0.05)
    free = {(p["k"], p["budget"]): p for p in plan.round_plans(rec, 1, overlap=True)}
    fixed = plan.Overhead(ssd_s=2.0)
    costly = {(p["k"], p["budget"]): p for p in plan.round_plans(rec, 1, overlap=True, overhead=fixed)}
    for key, p in free.items():  # hit or miss, every round pays it: the mean round is 2 s longer
        assert costly[key]["round_s"] == pytest.approx(p["round_s"] + 2.0)
        assert costly[key]["expected_speedup"] < p["expected_speedup"] and costly[key]["fixed_s"] == 2.0
    b0, b1 = plan.best_plan(list(free.values())), plan.best_plan(list(costly.values()))
    assert b1["expected_speedup"] < b0["expected_speedup"]
    assert b1["k"] > b0["k"]  # a round's fixed cost is spread over more tokens: a longer speculation pays


def _miss_record(t_one_row: float) -> Calibration:
    """A build that is cheap (many rows a step) and a re-draft at one row that costs ``t_one_row``."""
    rec = _record(0.0)
    rows = {"1": t_one_row, "2": 0.05, "4": 0.05, "12": 0.05}
    c = rec.costs
    costs = Costs(c.t_ar, c.t_verify, c.t_draft_step, c.c_round, {int(k): v for k, v in rows.items()})
    return Calibration(rec.alpha, rec.alpha_source, costs, rec.ranks, rec.rank_start)


def test_the_miss_path_picks_the_fast_backup_when_the_neural_one_is_priced_slow():
    oh = plan.Overhead(fast_s=0.01)
    slow = plan.best_plan(plan.round_plans(_miss_record(3.0), 1, True, overhead=oh, backup="best"))
    assert slow["backup"] == "fast" and slow["miss_path"]["fast"] > slow["miss_path"]["neural"]
    assert slow["expected_speedup"] == slow["miss_path"]["fast"]
    cheap = plan.best_plan(plan.round_plans(_miss_record(0.001), 1, True, overhead=oh, backup="best"))
    assert cheap["backup"] == "neural" and cheap["miss_path"]["neural"] > cheap["miss_path"]["fast"]
    # the fast backup's round after a miss yields one token: fewer tokens a round than the neural one's
    both = plan.round_plans(
        _miss_record(3.0), 1, True, ks=[4], budgets={4: [10]}, overhead=oh, backup="neural"
    )
    fast = plan.round_plans(_miss_record(3.0), 1, True, ks=[4], budgets={4: [10]}, overhead=oh, backup="fast")
    assert fast[0]["tokens_per_round"] < both[0]["tokens_per_round"]
    # what the engine runs decides the plan's own figure: auto is the neural backup on one device
    draft_spec = SpecConfig(method="ssd", draft="x", backup="auto")
    assert plan.miss_path_of(draft_spec, overlap=False) == "neural"
    assert plan.miss_path_of(draft_spec, overlap=True) == "best"
    assert plan.miss_path_of(SpecConfig(method="ssd", draft="x", backup="ngram"), overlap=False) == "fast"
    one = plan.best_ssd_plan(_miss_record(3.0), draft_spec, 1, overlap=False, overhead=oh)
    assert one["backup"] == "neural" and set(one["miss_path"]) == {"neural", "fast"}


def test_theorem7_against_a_hand_computed_case():
    # p 0.8, E_hit 4, E_miss 3, T_p 0.5 (hidden: max(1, T_p) = 1), T_b 0.4:
    # (0.8·4 + 0.2·3) / (0.8·1 + 0.2·1.4) = 3.8 / 1.08
    assert plan.theorem7(0.8, 4, 3, 0.5, 0.4) == pytest.approx(3.8 / 1.08)
    # batch 2 (Corollary 16): the hit path weighs p² = 0.64 -> 3.8 / (0.64 + 0.36·1.4)
    assert plan.theorem7(0.8, 4, 3, 0.5, 0.4, batch=2) == pytest.approx(3.8 / 1.144)
    # a build slower than the verify: max(1, T_p) = 1.5; an AR step half a verify halves it
    assert plan.theorem7(0.8, 4, 3, 1.5, 0.4, ar_per_verify=0.5) == pytest.approx(0.5 * 3.8 / 1.48)
    assert plan.sd_ceiling(4, 2.5, 0.6) == pytest.approx(1.6 * 4 / 2.5)


def test_a_run_carries_the_plan_the_bound_and_the_measurement(
    pair, ar_ref, tmp_path, monkeypatch, speculating
):
    monkeypatch.setenv("SSD_JAX_KAUTO_CACHE", str(tmp_path))
    target, draft = pair
    res = generate(target, PROMPTS, SP, SpecConfig(method="ssd", draft=draft, backup="neural"))
    assert _ids(res) == ar_ref
    m, p = res.metrics, res.metrics["plan"]
    oh = p["measured"]["round_overhead"]
    assert oh["source"] == "measured" and 0 < oh["ar_s"] and 0 < oh["sd_s"] and 0 < oh["ssd_s"]
    rnd = p["predicted"]["ssd_round"]
    assert rnd["fixed_s"] == pytest.approx(max(0.0, oh["ssd_s"] - oh["sd_s"]))
    assert p["predicted"]["miss_path"]["chosen"] == "neural" and p["chosen"]["backup"] == "neural"
    t7 = p["theorem7"]
    assert t7["hit_rate"] == m["cache_hit_rate"] and t7["predicted"] == p["predicted"]["expected_speedup"]
    rows, t_ar, v = len(PROMPTS), p["measured"]["t_ar"], rnd["verify_s"]
    assert t7["measured"] == pytest.approx(m["decode_tokens_per_s"] * t_ar / rows, rel=1e-3)
    bound = plan.theorem7(
        t7["hit_rate"], t7["e_hit"], t7["e_miss"], rnd["build_s"] / v, rnd["backup_s"] / v, rows
    )
    assert t7["bound"] == pytest.approx(bound * t_ar / v, rel=1e-3) and "Theorem 7 bound" in t7["line"]
    # a second run reads the fixed cost from the cache
    again = generate(target, PROMPTS, SP, SpecConfig(method="ssd", draft=draft, backup="neural"))
    assert again.metrics["plan"]["measured"]["round_overhead"]["source"] == "cache"
    assert np.isfinite(again.metrics["plan"]["theorem7"]["bound"])


def test_the_cli_prints_the_runs_bound_beside_its_prediction(
    tiny_llama_path, tmp_path, monkeypatch, capsys, speculating
):
    from ssd_jax.cli.decode import main

    monkeypatch.setenv("SSD_JAX_KAUTO_CACHE", str(tmp_path))
    args = ["--target", tiny_llama_path, "--draft", tiny_llama_path, "--method", "ssd", "--backup", "neural"]
    assert main([*args, "--prompt-ids", "1,2,3,1,2,3", "--max-new-tokens", "8", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "SSD fixed cost +" in err and "on a miss neural" in err  # the plan line
    line = next(x for x in err.splitlines() if x.startswith("[ssd] predicted"))
    assert "Theorem 7 bound" in line and "measured" in line
