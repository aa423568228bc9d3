"""SDSL (speculative decoding scaling laws): closed forms, the paper's numbers, the CLI contract.

Pure numpy math (nothing is compiled); the whole file runs in a few seconds.
"""

import json
import math
import subprocess
import sys

import chex
import numpy as np
import pytest

from ssd_jax.analysis import sdsl
from ssd_jax.cli import sdsl as sdsl_cli


# --- Lambert W₋₁ ------------------------------------------------------------------------
def test_lambertw_m1_solves_w_exp_w_over_the_branch():
    e_inv = math.exp(-1.0)
    z = -e_inv * np.array(
        [1.0, 1 - 1e-15, 1 - 1e-12, 1 - 1e-8, 1 - 1e-4, 0.99, 0.9, 0.5, 0.1, 1e-3, 1e-10, 1e-50, 1e-100]
    )
    w = sdsl.lambertw_m1(z)
    assert np.all(w <= -1.0)
    chex.assert_trees_all_close(w * np.exp(w), z, rtol=1e-12, atol=0.0)
    assert w[0] == -1.0  # the branch point
    # values of W₋₁ from the literature
    chex.assert_trees_all_close(
        sdsl.lambertw_m1(np.array([-0.1, -0.2, -1e-3])),
        np.array([-3.577152063957297, -2.542641357773527, -9.118006470402742]),
        rtol=1e-12,
    )


def test_lambertw_m1_log_form_handles_underflowing_z():
    # z = -exp(L) underflows to 0 for L < -745; the log form still solves w + ln(-w) = L
    L = np.array([-1.0 - 1e-14, -1.0 - 1e-6, -2.0, -10.0, -250.3, -800.0, -1e4, -1e8, -1e300])
    w = sdsl.lambertw_m1_log(L)
    assert np.all(w <= -1.0)
    chex.assert_trees_all_close(w + np.log(-w), L, rtol=1e-13, atol=1e-13)


def test_lambertw_m1_outside_the_branch_is_nan():
    assert np.all(np.isnan(sdsl.lambertw_m1(np.array([-0.5, 0.0, 0.1, np.nan]))))
    assert np.isnan(sdsl.lambertw_m1_log(-0.5))


# --- optimal lookahead ------------------------------------------------------------------
def _brute_force_gamma(alpha, r, hi=200.0, step=1e-4):
    g = np.arange(0.0, hi, step)
    t = sdsl.throughput(alpha, g, 1.0, r)  # only M/N matters
    return g[int(np.argmax(t))]


def test_gamma_star_paper_check_and_brute_force():
    g = float(sdsl.gamma_star(0.7, 700.0))
    assert abs(g - 14.545) <= 0.01, g  # docs/reference.md §7: α=0.7, N=100M, M=70B
    assert abs(g - _brute_force_gamma(0.7, 700.0)) <= 2e-4
    # same as giving N and M (r = 70e9 / 100e6)
    chex.assert_trees_all_close(sdsl.gamma_star(0.7, 70e9 / 100e6), g, rtol=1e-12)


@pytest.mark.parametrize(
    "alpha,r", [(0.5, 20.0), (0.8, 50.0), (0.9, 300.0), (0.6, 1000.0), (0.95, 5000.0), (0.3, 3.0)]
)
def test_gamma_star_matches_brute_force(alpha, r):
    assert abs(float(sdsl.gamma_star(alpha, r)) - _brute_force_gamma(alpha, r)) <= 2e-4


def test_gamma_star_is_vectorised_and_clips_at_zero():
    a = np.array([0.5, 0.7, 0.9])
    r = np.array([[10.0], [100.0], [1000.0]])
    g = sdsl.gamma_star(a, r)
    assert g.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            chex.assert_trees_all_close(g[i, j], sdsl.gamma_star(a[j], r[i, 0]), rtol=1e-12)
    # a draft as large as the target never pays: no stationary point, best γ is 0
    chex.assert_trees_all_close(sdsl.gamma_star(0.7, np.array([0.5, 1.0, 1.01])), np.zeros(3))
    assert np.isnan(sdsl.gamma_star(0.7, 0.5, clip=False))
    assert sdsl.gamma_star(0.7, 1.01, clip=False) < 0
    with pytest.raises(ValueError):
        sdsl.gamma_star(1.0, 10.0)


@pytest.mark.parametrize("alpha,r", [(0.7, 700.0), (0.5, 30.0), (0.85, 250.0), (0.66, 247.0)])
def test_throughput_at_gamma_star_beats_neighbours(alpha, r):
    g = float(sdsl.gamma_star(alpha, r))
    t = lambda x: float(sdsl.throughput(alpha, x, 1.0, r))
    assert t(g) >= t(g + 1.0) and t(g) >= t(max(g - 1.0, 0.0))
    assert t(g) >= t(g + 1e-3) and t(g) >= t(g - 1e-3)
    gi = float(sdsl.best_integer_gamma(alpha, r))
    assert gi == round(gi) and abs(gi - g) < 1.0
    assert t(gi) >= t(gi + 1.0) and t(gi) >= t(gi - 1.0)


def test_speedup_and_throughput_agree():
    a, g, N, M = 0.7, np.array([0.0, 3.0, 14.5]), 1e8, 70e9
    chex.assert_trees_all_close(sdsl.speedup(a, g, N, M), 2 * M * sdsl.throughput(a, g, N, M), rtol=1e-12)
    chex.assert_trees_all_close(sdsl.speedup(a, 0.0, N, M), 1.0)  # γ = 0 is plain decoding
    chex.assert_trees_all_close(sdsl.expected_tokens(0.5, 2.0), 1.75)  # 1 + .5 + .25


# --- laws ---------------------------------------------------------------------------------
def test_alpha_from_ppl():
    chex.assert_trees_all_close(sdsl.alpha_from_ppl(10.0, 8.0), 0.679, atol=5e-4)
    chex.assert_trees_all_close(
        sdsl.alpha_from_ppl(10.0, 8.0), -0.0067 * 10 + 0.01297 * 8 + 0.642, rtol=1e-14
    )
    # the linear law leaves (0, 1) for very weak drafts: clipped unless asked not to
    assert sdsl.alpha_from_ppl(500.0, 8.0) == sdsl.ALPHA_EPS
    assert sdsl.alpha_from_ppl(500.0, 8.0, clip=False) < 0


def test_loss_law():
    chex.assert_trees_all_close(sdsl.loss(np.inf, np.inf), 1.69)
    chex.assert_trees_all_close(
        sdsl.loss(1e9, 1e12), 1.69 + 406.4 / 1e9**0.34 + 410.7 / 1e12**0.28, rtol=1e-14
    )
    chex.assert_trees_all_close(sdsl.perplexity(1e9, 1e12), np.exp(sdsl.loss(1e9, 1e12)), rtol=1e-14)


def test_refit_acceptance_recovers_constants():
    rng = np.random.default_rng(0)
    x = rng.uniform(5, 30, 40)
    y = rng.uniform(4, 12, 40)
    alphas = 0.5 - 0.01 * x + 0.02 * y
    A, B, C, r2 = sdsl.refit_acceptance(x, y, alphas)
    chex.assert_trees_all_close((A, B, C, r2), (-0.01, 0.02, 0.5, 1.0), atol=1e-10)
    # with noise R² drops below 1 and the constants stay close
    A, B, C, r2 = sdsl.refit_acceptance(x, y, alphas + rng.normal(0, 0.005, 40))
    assert 0.8 < r2 < 1.0
    chex.assert_trees_all_close((A, B), (-0.01, 0.02), atol=3e-3)


# --- draft sizing: the paper's numbers --------------------------------------------------
def test_n_opt_70b_matches_paper():
    p = sdsl.optimal_draft(70e9)
    assert abs(p.N / 0.28e9 - 1) < 0.10, p.N
    assert 8 < p.gamma < 13 and 0.6 < p.alpha < 0.7 and 2 < p.speedup < 3.5
    assert sdsl.n_opt(70e9) == p.N
    # the refined optimum beats its neighbours
    for f in (0.99, 1.01, 0.9, 1.1):
        assert sdsl.evaluate_draft(70e9, p.N * f).throughput <= p.throughput
    # integer lookahead moves it only a little
    assert abs(sdsl.n_opt(70e9, integer_gamma=True) / p.N - 1) < 0.05


def test_fit_linear_reproduces_paper():
    f = sdsl.fit_linear()
    assert abs(f.mu / 2.71e-3 - 1) < 0.05, f.mu
    assert abs(f.M0 / 8.71e7 - 1) < 0.10, f.M0
    assert f.r2 > 0.98
    assert min(f.Ms) == 13e9 and max(f.Ms) == 110e9


def test_training_tokens_barely_matter():
    n = [sdsl.n_opt(70e9, D) for D in (1e11, 1e12, 1e13)]
    assert max(n) / min(n) < 1.3
    assert n[0] > n[1] > n[2]  # more data makes small drafts better


def test_flatness_matches_paper():
    rows = sdsl.flatness(70e9, drafts=[1e9, 8e9])
    by_factor = {r["factor"]: r for r in rows[:4]}
    for f in (0.5, 2.0):
        assert 0 < by_factor[f]["loss_pct"] < 3
    for f in (0.25, 4.0):
        assert 2 < by_factor[f]["loss_pct"] < 10
    one_b, eight_b = rows[4], rows[5]
    assert one_b["N"] == 1e9 and eight_b["N"] == 8e9
    assert 2 < one_b["loss_pct"] < 8  # paper: ≈5%
    assert 25 < eight_b["loss_pct"] < 40  # paper: ≈34%
    for r in rows:
        assert r["rel_throughput"] <= 1.0
        chex.assert_trees_all_close(r["loss_pct"], 100 * (1 - r["rel_throughput"]))


def test_small_targets_use_the_full_optimisation():
    p = sdsl.optimal_draft(135e6)
    assert p.N < 0.2 * (2.71e-3 * 135e6 + 8.71e7)  # the linear rule would say a draft near the target size
    assert p.gamma > 0 and p.speedup > 1


def test_bad_sizes_raise_user_error():
    with pytest.raises(sdsl.UserError):
        sdsl.n_opt(-1.0)
    with pytest.raises(sdsl.UserError):
        sdsl.n_opt(70e9, D=0.0)
    with pytest.raises(sdsl.UserError):
        sdsl.evaluate_draft(70e9, np.nan)


# --- CLI ------------------------------------------------------------------------------------
def _one_line_error(rc, capsys, needle):
    out, err = capsys.readouterr()
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle.lower() in lines[0].lower(), err
    assert "Traceback" not in err and out == ""


def test_cli_json(capsys):
    assert sdsl_cli.main(["--target-params", "70e9", "--json", "--drafts", "1e9,8e9"]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert abs(d["n_opt"] / 0.28e9 - 1) < 0.1
    assert d["linear_rule"]["in_range"] and "13-110B" in d["linear_rule"]["note"]
    assert len(d["flatness"]) == 6
    assert {"gamma_star", "alpha", "speedup", "tokens", "draft_ppl", "target_ppl"} <= set(d)


def test_cli_text_and_fit(capsys):
    assert sdsl_cli.main(["--target-params", "1.5B", "--fit"]) == 0
    out, _ = capsys.readouterr()
    assert "N_opt" in out and "OUTSIDE the fitted 13-110B range" in out
    assert "only" in out and "full optimisation" in out
    assert "mu = " in out and "M0 = " in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target-params", "0"], "positive"),
        (["--target-params=-7e9"], "positive"),
        (["--target-params", "seventy"], "not a number"),
        (["--target", "no-such-model-xyz"], "unknown model"),
        (["--target-params", "70e9", "--tokens", "0"], "positive"),
        ([], "--target"),
        (["--no-such-flag"], "unrecognized"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(capsys, args, needle):
    try:
        rc = sdsl_cli.main(args)
    except SystemExit as e:  # argparse errors
        rc = e.code
    _one_line_error(rc, capsys, needle)


def test_cli_target_counts_parameters_from_config(tmp_path, capsys):
    from ssd_jax.models.config import ModelConfig
    from ssd_jax.models.params import count_params

    hf = dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: only the config is
    total = count_params(ModelConfig.from_hf(hf), include_embeddings=True)
    assert sdsl_cli.main(["--target", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["param_count"]["total"] == total == d["target_params"]
    assert d["param_count"]["used"] == "total"
    assert d["param_count"]["non_embedding"] == total - 2 * 32000 * 2048


def test_cli_module_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "ssd_jax.sdsl", "--target-params", "70e9", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert abs(json.loads(r.stdout)["n_opt"] / 0.28e9 - 1) < 0.1
    r = subprocess.run(
        [sys.executable, "-m", "ssd_jax.sdsl", "--target-params", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
