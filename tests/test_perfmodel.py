"""The performance model: roofline regimes, SD / SSD formulas, calibration, validation bookkeeping."""

import json

import numpy as np
import pytest

from ssd_jax.analysis import perfmodel as pm
from ssd_jax.cli import perfmodel as perfmodel_cli
from ssd_jax.decoding.ssd import fanout

H100 = pm.HARDWARE["h100-sxm"]
T70, D1 = pm.model_shape("llama-3.1-70b"), pm.model_shape("llama-3.2-1b")
Q15, Q05 = pm.model_shape("qwen2.5-coder-1.5b-instruct"), pm.model_shape("qwen2.5-coder-0.5b-instruct")


def test_model_shapes_match_measured_parameter_counts():
    # experiments/results/ar_cpu.json: params and f32 weight bytes per token
    assert Q15.params == 1_777_088_000 and Q15.weight_bytes(4) == 6_174_857_216
    assert Q05.params == 630_167_424 and Q05.weight_bytes(4) == 1_976_131_072
    assert pm.model_shape("smollm2-135m-instruct").weight_bytes(4) == 538_060_032
    assert abs(T70.params / 1e9 - 70.55) < 0.01 and abs(D1.params / 1e9 - 1.236) < 0.001
    first = pm.model_shape("qwen2.5-coder-1.5b-instruct-first-4-layers")
    assert first.layers == 4 and first.vocab == Q15.vocab


def test_memory_bound_at_batch_1_compute_bound_at_large_batch():
    f1 = pm.forward_time(H100, T70, batch=1, context=512)
    assert f1.bound == "memory"
    assert f1.memory == pytest.approx(T70.weight_bytes(2) / H100.bw, rel=0.01)
    big = pm.forward_time(H100, T70, batch=2048, context=512)
    assert big.bound == "compute"
    # at batch 1 a few extra tokens are free; at large batch time grows ~linearly
    assert pm.forward_time(H100, T70, batch=1, tokens=8).total == pytest.approx(f1.total, rel=0.01)
    b4k = pm.forward_time(H100, T70, batch=4096, context=512)
    assert b4k.total / big.total == pytest.approx(2.0, rel=0.1)
    # tensor parallelism splits the memory time and adds communication
    f4 = pm.forward_time(H100, T70, batch=1, context=512, tp=4)
    assert f4.memory == pytest.approx(f1.memory / 4) and f4.comm > 0


def _simple_hw(**kw):
    base = dict(
        name="toy",
        hbm_gb_s=1000.0,
        peak_tflops=1e6,
        memory_gb=1e6,
        step_overhead_s=1e-3,
        host_overhead_s=2e-3,
        link_gb_s=100.0,
        link_latency_s=5e-6,
        bw_eff=1.0,
        flop_eff=1.0,
        m_half=0.0,
        sample_s_per_logit=0.0,
        bytes_per_param=2,
    )
    base.update(kw)
    return pm.Hardware(**base)


def test_sd_prediction_equals_hand_computation():
    hw = _simple_hw()
    alpha, k = 0.8, 5
    # memory bound: every forward costs overhead + weight bytes / bandwidth (context 0)
    t_d = 1e-3 + Q05.weight_bytes(2) / 1e12
    t_v = 1e-3 + Q15.weight_bytes(2) / 1e12
    round_s = k * t_d + t_v + 2e-3
    tau = (1 - alpha ** (k + 1)) / (1 - alpha)
    p = pm.predict_sd(hw, Q15, Q05, k=k, alpha=alpha, context=0)
    assert p.tokens_per_round == pytest.approx(tau)
    assert p.round_s == pytest.approx(round_s)
    assert p.tokens_per_s == pytest.approx(tau / round_s)
    ar = pm.predict_ar(hw, Q15, context=0)
    assert ar.tokens_per_s == pytest.approx(1 / (t_v + 2e-3))
    # a measured tokens-per-round overrides alpha; per-step host syncs add K host overheads
    q = pm.predict_sd(
        hw, Q15, Q05, k=k, tokens_per_round=3.0, p_catch_up=0.0, context=0, draft_loop="per_step"
    )
    assert q.tokens_per_s == pytest.approx(3.0 / (round_s + k * 2e-3))


def test_expected_tokens_and_inverse():
    assert pm.expected_tokens(0.0, 4) == 1.0 and pm.expected_tokens(1.0, 4) == 5.0
    for a in (0.3, 0.7, 0.888, 0.95):
        assert pm.alpha_for_tokens(pm.expected_tokens(a, 7), 7) == pytest.approx(a, abs=1e-9)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("backup", ["neural", "fast"])
def test_ssd_reduces_to_theorem_7(shared, backup):
    hw = pm.HARDWARE["h200"]
    for batch in (1, 4):
        p = pm.predict_ssd(
            hw,
            Q15,
            Q05,
            k=4,
            fan_budget=10,
            p_hit=0.7,
            tau_hit=4.0,
            tau_miss=3.0,
            batch=batch,
            context=200,
            shared=shared,
            backup=backup,
            t_fast=1e-4,
        )
        u = p.parts["verify"] + p.parts["overhead"]
        build, tb = p.parts["build"], p.parts["backup"]
        if shared:  # nothing hides: the build is serialised into every round
            u, tp = u + build, 0.0
        else:
            tp = build / u
        q = 0.7**batch
        s_hand = (0.7 * 4.0 + 0.3 * 3.0) / (q * max(1.0, tp) + (1 - q) * (1 + tb / u))
        assert p.tokens_per_s == pytest.approx(s_hand / u)
        assert p.tokens_per_s == pytest.approx(fanout.predicted_speedup(0.7, 4.0, 3.0, tp, tb / u, batch) / u)
        assert p.devices == (1 if shared else 2)


def test_ssd_never_exceeds_the_ceiling_over_sd():
    rng = np.random.default_rng(0)
    for _ in range(300):
        hw = pm.HARDWARE[str(rng.choice(["h100-sxm", "h200", "a100-80gb", "tpu-v5e"]))].replace(
            host_overhead_s=float(rng.uniform(0, 3e-3)), link_latency_s=float(rng.uniform(0, 3e-5))
        )
        tgt, drf = [(T70, D1), (Q15, Q05)][rng.integers(2)]
        tp = 4 if tgt is T70 else 1
        k = int(rng.integers(1, 9))
        a = float(rng.uniform(0.2, 0.97))
        p_hit = float(rng.uniform(0, 1))
        e = pm.expected_tokens(a, k)
        e_miss = float(rng.uniform(1, e))
        batch = int(rng.integers(1, 9))
        sd = pm.predict_sd(hw, tgt, drf, k=k, alpha=a, p_catch_up=0.0, batch=batch, tp=tp)
        ssd = pm.predict_ssd(
            hw,
            tgt,
            drf,
            k=k,
            fan_budget=int(rng.integers(1, 33)),
            p_hit=p_hit,
            tau_hit=e,
            tau_miss=e_miss,
            batch=batch,
            tp=tp,
            shared=bool(rng.integers(2)),
        )
        ceiling = (1 + sd.info["T_SD"]) * e / sd.tokens_per_round
        assert ssd.tokens_per_s / sd.tokens_per_s <= ceiling * (1 + 1e-9)


def test_fit_recovers_known_constants_from_synthetic_timings():
    true = pm.HARDWARE["cpu"].replace(step_overhead_s=4e-3, bw_eff=0.72, flop_eff=0.45, m_half=11.0)
    models = [Q15, Q05, pm.model_shape("smollm2-135m-instruct")]
    samples = [
        pm.ForwardSample(m, 1, 1, 100.0, pm.forward_time(true, m, context=100.0).total) for m in models
    ]
    for m in models[:2]:
        for b, t in ((1, 5), (1, 8), (4, 5), (16, 1)):
            samples.append(
                pm.ForwardSample(
                    m, b, t, 100.0, pm.forward_time(true, m, batch=b, tokens=t, context=100.0).total
                )
            )
    prior = true.replace(step_overhead_s=0.0, bw_eff=0.9, flop_eff=0.6, m_half=0.0)
    fit, rep = pm.fit_forward(prior, samples)
    assert {"step_overhead_s", "bw_eff", "flop_eff", "m_half"} <= set(rep["fitted"])
    assert fit.step_overhead_s == pytest.approx(4e-3, rel=1e-6)
    assert fit.bw_eff == pytest.approx(0.72, rel=1e-6)
    assert fit.flop_eff == pytest.approx(0.45, rel=1e-6)
    assert fit.m_half == pytest.approx(11.0, rel=1e-6)
    # with one distinct token count only m_half is fitted, flop_eff is kept from the prior
    one = [s for s in samples if s.batch * s.tokens in (1, 5)]
    fit1, rep1 = pm.fit_forward(prior.replace(flop_eff=0.45), one)
    assert "flop_eff" in rep1["kept"] and fit1.m_half == pytest.approx(11.0, rel=1e-6)


def _synthetic_results(tmp_path, hw):
    """AR-suite, n-gram, SD and SSD rows generated by the model itself on ``hw``."""
    ar = {"suite": "ar", "env": {}, "rows": []}
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        t = pm.predict_ar(hw, pm.model_shape(name), context=64.0).round_s
        ar["rows"].append({"model": name, "dtype": "float32", "tpot_s": t, "tpot_s_all": [t, t, t]})
    rows, k, gen, steps = [], 4, 65, 16
    ctx = 40 + gen / 2

    def timing(p, dtok):
        return {"generated_tokens": gen, "ttft_s": 1.0, "wall_s": 1.0 + dtok / p.tokens_per_s}

    for cat in ("code", "math"):
        p = pm.predict_ar(hw, Q15, context=ctx)
        rows.append(
            {
                "suite": "main",
                "category": cat,
                "method": "ar",
                "batch_size": 1,
                "prompt_tokens": 40,
                "loadavg": [1, 1, 1],
                **timing(p, gen - 1),
            }
        )
        tau = (gen - 1) / steps
        ng = pm.predict_sd(hw, Q15, Q15, k=k, tokens_per_round=tau, p_catch_up=0.0, context=ctx)
        t_round = ng.round_s - ng.parts["draft"]
        rows.append(
            {
                "suite": "main",
                "category": cat,
                "method": "ngram-k4",
                "draft": "ngram",
                "batch_size": 1,
                "prompt_tokens": 40,
                "k": k,
                "verify_steps": steps,
                "loadavg": [1, 1, 1],
                "generated_tokens": gen,
                "ttft_s": 1.0,
                "wall_s": 1.0 + steps * t_round,
                "verify_s": steps * ng.parts["verify"],
                "draft_s": 0.0,
                "sample_s": steps * pm.sample_time(hw, Q15, k + 1),
                "overhead_s": steps * hw.host_overhead_s,
                "acceptance_rate": 0.5,
                "acceptance_histogram": [4, 4, 4, 2, 2],
            }
        )
        hist = [2, 2, 2, 2, 8]
        sd = pm.predict_sd(hw, Q15, Q05, k=k, tokens_per_round=tau, p_catch_up=0.5, context=ctx)
        rows.append(
            {
                "suite": "main",
                "category": cat,
                "method": "sd-k4",
                "batch_size": 1,
                "prompt_tokens": 40,
                "k": k,
                "verify_steps": steps,
                "loadavg": [1, 1, 1],
                **timing(sd, gen - 1),
                "verify_s": steps * sd.parts["verify"],
                "draft_s": steps * sd.parts["draft"],
                "sample_s": 0.1,
                "overhead_s": 0.01,
                "acceptance_rate": 0.7,
                "acceptance_histogram": hist,
            }
        )
        ssd = pm.predict_ssd(
            hw, Q15, Q05, k=k, fan_budget=10, p_hit=0.6, tau_hit=4.5, tau_miss=3.0, context=ctx, shared=True
        )
        rows.append(
            {
                "suite": "main",
                "category": cat,
                "method": "ssd-k4",
                "batch_size": 1,
                "prompt_tokens": 40,
                "k": k,
                "verify_steps": steps,
                "loadavg": [1, 1, 1],
                **timing(ssd, gen - 1),
                "verify_s": steps * ssd.parts["verify"],
                "draft_s": steps * ssd.parts["build"],
                "draft_exposed_s": steps * ssd.parts["draft_exposed"],
                "sample_s": 0.1,
                "overhead_s": 0.01,
                "acceptance_rate": 0.7,
                "acceptance_histogram": hist,
                "cache_hit_rate": 0.6,
                "tau_hit": 4.5,
                "tau_miss": 3.0,
                "fanout": {"budget": 10},
                "backup": "neural",
                "devices": {"single_device": True, "target": 1, "draft": 1},
            }
        )
    ssd_res = {"suite": "ssd", "env": {}, "target": Q15.name, "draft": Q05.name, "k": k, "rows": rows}
    paths = []
    for name, res in (("ar_cpu.json", ar), ("ssd_cpu_test.json", ssd_res)):
        (tmp_path / name).write_text(json.dumps(res))
        paths.append(str(tmp_path / name))
    return paths


def test_validate_is_exact_on_data_generated_by_the_model(tmp_path):
    true = pm.HARDWARE["cpu"].replace(
        step_overhead_s=7e-3, bw_eff=0.8, m_half=15.0, host_overhead_s=1.5e-3, sample_s_per_logit=1.5e-8
    )
    v = pm.validate(_synthetic_results(tmp_path, true))
    hw = v["hardware"]
    assert hw["step_overhead_s"] == pytest.approx(7e-3, rel=1e-3)
    assert hw["bw_eff"] == pytest.approx(0.8, rel=1e-3)
    assert hw["m_half"] == pytest.approx(15.0, rel=1e-3)
    kinds = {g["kind"] for g in v["groups"]}
    assert kinds == {"ar", "sd", "ngram", "ssd"}
    for g in v["groups"]:
        assert g["rel_err"] == pytest.approx(0.0, abs=2e-3), g
        assert g["fitted"] == (g["kind"] == "ngram")
    ssd = [g for g in v["groups"] if g["kind"] == "ssd"][0]
    assert ssd["m_vs_sd"] == pytest.approx(ssd["p_vs_sd"], rel=2e-3)
    md = pm.render_validation(v)
    assert "Predicted vs measured" in md and "ssd-k4" in md


def test_paper_prediction_within_factor_2_of_the_papers_ratio():
    d = pm.predict_paper()
    p = d["predictions"]
    assert d["fits"]
    ratio = p["ssd"].tokens_per_s / p["ar"].tokens_per_s
    paper = pm.PAPER["ssd"] / pm.PAPER["ar"]
    assert 0.5 < ratio / paper < 2.0
    assert p["ssd"].devices == 5 and p["ar"].devices == 4
    assert p["ssd"].tokens_per_s / p["sd"].tokens_per_s <= d["ssd_over_sd_ceiling"]
    # 70B does not fit on four 16 GB TPU v5e chips
    assert not pm.predict_paper(pm.HARDWARE["tpu-v5e"])["fits"]


def test_qwen_prediction_single_and_two_devices():
    d = pm.predict_qwen(results=[])
    p = d["predictions"]
    assert p["ssd1"].devices == 1 and p["ssd2"].devices == 2
    assert p["ssd2"].tokens_per_s > p["ssd1"].tokens_per_s  # a second device lets the build overlap
    assert p["ssd2"].tokens_per_s_per_device == pytest.approx(p["ssd2"].tokens_per_s / 2)


def test_cli_json_and_markdown(capsys):
    assert perfmodel_cli.main(["--predict", "paper", "qwen-h200", "--acceptance-from", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (
        doc["paper"]["predictions"]["ssd"]["tokens_per_s"] > doc["paper"]["predictions"]["ar"]["tokens_per_s"]
    )
    assert perfmodel_cli.main(["--predict", "paper"]) == 0
    assert "SSD / AR" in capsys.readouterr().out


def test_measure_forward_on_a_tiny_model(tmp_path):
    from ssd_jax.models.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
    )
    out = tmp_path / "fwd.json"
    res = pm.measure_forward(
        ["tiny"],
        dtype="float32",
        shapes=((1, 1), (1, 3)),
        context=8,
        repeats=2,
        out=str(out),
        configs={"tiny": cfg},
    )
    assert json.loads(out.read_text())["rows"] == res["rows"]
    assert [(r["batch"], r["tokens"]) for r in res["rows"]] == [(1, 1), (1, 3)]
    assert all(r["seconds"] > 0 for r in res["rows"])
    samples = pm.forward_samples({**res, "_path": str(out)})
    assert samples[0].model.layers == 2 and samples[1].tokens == 3


def test_update_doc_rewrites_only_the_marked_blocks(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "intro\n<!-- perfmodel:hardware -->\nold\n<!-- /perfmodel:hardware -->\nprose\n"
        "<!-- perfmodel:paper -->\nold\n<!-- /perfmodel:paper -->\nend\n"
    )
    pm.update_doc(str(doc), [])
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("end\n") and "prose" in text
    assert "| h100-sxm |" in text and "SSD / AR" in text
    pm.update_doc(str(doc), [])
    assert doc.read_text() == text  # idempotent
