"""The perf model's split validation: split rules, protocol cells, fit isolation, error arithmetic (no models)."""

import json
import math

import pytest

from ssd_jax.analysis import perfmodel as pm
from ssd_jax.bench import perfsplit as ps
from ssd_jax.bench.stats import mean_ci

TARGET = "smollm2-135m-instruct"


def _run(method, cat, prompt, repeat, tok_s, b=1, tpr=None, acc=None):
    return {
        "kind": "run",
        "batch_size": b,
        "category": cat,
        "prompt_index": prompt,
        "repeat": repeat,
        "method": method,
        "new_tokens": 48,
        "loadavg_before": 2.0,
        "loadavg_after": 2.2,
        "decode_tok_s": tok_s,
        "tokens_per_round": tpr,
        "acceptance_rate": acc,
    }


def _write_protocol(path, runs, draft=None):
    env = {"kind": "env", "target": TARGET, "draft": draft, "config": {"batch_size": runs[0]["batch_size"]}}
    path.write_text("\n".join(json.dumps(r) for r in [env, *runs]) + "\n")


def _split(tmp_path, **kw):
    sp = {
        "sources": ["res/protocol_*.jsonl"],
        "fit_constants": ["step_overhead_s"],
        "hardware": "cpu",
        "fit": [{"label": "fit", "glob": "res/protocol_a.jsonl", "where": {"batch": 1, "kind": ["ar"]}}],
        "holdout": [
            {"label": "batch > 1", "where": {"batch": {"min": 2}}},
            {"label": "n-gram", "where": {"kind": "ngram"}},
        ],
        **kw,
    }
    p = tmp_path / "split.json"
    p.write_text(json.dumps(sp))
    return p


def test_split_rules_match_and_label():
    cell = {
        "file": "experiments/results/protocol_cpu_qwen_b16.jsonl",
        "batch": 16,
        "kind": "sd",
        "target": "q",
    }
    assert ps.matches(
        {"glob": "experiments/results/protocol_cpu_*.jsonl", "where": {"batch": {"min": 2}}}, cell
    )
    assert not ps.matches({"where": {"batch": {"max": 1}}}, cell)
    assert ps.matches({"where": {"kind": ["ar", "sd"], "target": {"not": ["smollm2"]}}}, cell)
    assert not ps.matches({"where": {"target": {"not": "q"}}}, cell)
    split = {
        "fit": [{"glob": "a.jsonl", "where": {"batch": 1}}],
        "holdout": [{"label": "big", "where": {"batch": 16}}],
    }
    cells = ps.assign(split, [dict(cell), {"file": "a.jsonl", "batch": 1}, {"file": "new.jsonl", "batch": 1}])
    assert [(c["in_sample"], c["label"]) for c in cells] == [
        (False, "big"),
        (True, "fit"),
        (False, "held out (no rule: other run)"),
    ]


def test_load_split_rejects_unknown_fields(tmp_path):
    p = _split(tmp_path, fit=[{"where": {"bogus": 1}}])
    with pytest.raises(Exception, match="bogus"):
        ps.load_split(p)
    p = _split(tmp_path, fit_constants=["no_such_constant"])
    with pytest.raises(Exception, match="no_such_constant"):
        ps.load_split(p)


def test_protocol_cells_aggregate_prompts_then_repeats(tmp_path):
    runs = [_run("ar", "code", p, r, 10.0 + p + 0.5 * r) for p in range(3) for r in range(2)]
    runs += [_run("ngram-kauto", "code", p, r, 12.0, tpr=1.5, acc=0.5) for p in range(3) for r in range(2)]
    runs += [_run("ngram-kauto", "code", 3, 0, 12.0, tpr=1.3, acc=0.6)]  # proposed fewer than K this time
    f = tmp_path / "p.jsonl"
    _write_protocol(f, runs)
    cells = {c["method"]: c for c in ps.protocol_cells(f, "p.jsonl")}
    ar = cells["ar"]
    assert (ar["prompts"], ar["runs"], ar["kind"], ar["k"]) == (3, 6, "ar", None)
    m, lo, hi = mean_ci([10.25, 11.25, 12.25])  # per-prompt means of the repeats
    assert ar["measured"] == pytest.approx(m) and ar["ci"] == pytest.approx((lo, hi))
    ng = cells["ngram-kauto"]
    assert ng["k"] == 1 and ng["kind"] == "ngram" and ng["draft"] is None
    assert ng["tokens_per_round"] == pytest.approx((6 * 1.5 + 1.3) / 7)
    assert ng["load"] == pytest.approx(2.1)


def test_k_and_vocab_from_method_names():
    assert ps.infer_k([{"tokens_per_round": 2.5, "acceptance_rate": 0.5}]) == 3
    assert ps.protocol_kind("sd-kauto-v4096") == "sd" and ps.protocol_kind("ssd-k4") == "ssd"
    assert ps.protocol_kind("ngram-k2") == "ngram" and ps.protocol_kind("ar") == "ar"


def _two_files(tmp_path, heldout_ar):
    res = tmp_path / "res"
    res.mkdir(exist_ok=True)
    fit = [_run("ar", c, p, r, 20.0 + (p % 2)) for c in ("code", "chat") for p in range(3) for r in range(2)]
    _write_protocol(res / "protocol_a.jsonl", fit)
    held = [_run("ar", "code", p, 0, heldout_ar, b=4) for p in range(3)]
    held += [_run("ngram-kauto", "code", p, 0, 25.0, tpr=1.4, acc=0.4) for p in range(3)]
    _write_protocol(res / "protocol_b.jsonl", held)


def test_held_out_cells_never_influence_the_fit(tmp_path):
    _two_files(tmp_path, heldout_ar=30.0)
    v1 = ps.validate_split(_split(tmp_path), root=tmp_path)
    _two_files(tmp_path, heldout_ar=3000.0)
    v2 = ps.validate_split(_split(tmp_path), root=tmp_path)
    assert v1["hardware"] == v2["hardware"]
    assert v1["hardware"]["step_overhead_s"] != pm.HARDWARE["cpu"].step_overhead_s  # it was fitted
    labels = {(c["file"], c["method"]): (c["in_sample"], c["label"]) for c in v1["cells"]}
    assert labels[("res/protocol_a.jsonl", "ar")] == (True, "fit")
    assert labels[("res/protocol_b.jsonl", "ar")] == (False, "batch > 1")
    assert labels[("res/protocol_b.jsonl", "ngram-kauto")] == (False, "n-gram")
    held = [c for c in v2["cells"] if not c["in_sample"] and c["kind"] == "ar"]
    assert held[0]["rel_err"] == pytest.approx(held[0]["predicted"] / 3000.0 - 1)
    md = ps.render_split(v1)
    assert "| out | n-gram |" in md and "max abs error" in md


def test_fit_recovers_a_known_step_overhead(tmp_path):
    hw = pm.HARDWARE["cpu"].replace(step_overhead_s=0.012)
    truth = ps.predict_cell(hw, {"target": TARGET, "batch": 1, "kind": "ar", "new_tokens": 48})
    cells = [{"target": TARGET, "batch": 1, "kind": "ar", "new_tokens": 48, "measured": truth}]
    fitted, rep = ps.fit_constants(pm.HARDWARE["cpu"], cells, ["step_overhead_s"])
    assert fitted.step_overhead_s == pytest.approx(0.012, rel=1e-4) and rep["rms_log_residual"] < 1e-6


def test_error_summary_max_and_mean():
    cells = [
        {"in_sample": True, "kind": "ar", "rel_err": 0.1, "in_ci": True},
        {"in_sample": True, "kind": "ar", "rel_err": -0.3, "in_ci": False},
        {"in_sample": False, "kind": "sd", "rel_err": 0.5, "in_ci": None},
        {"in_sample": False, "kind": "sd", "rel_err": -0.2, "in_ci": False},
        {"in_sample": False, "kind": "ssd", "rel_err": None, "in_ci": None},
    ]
    s = {(r["sample"], r["kind"]): r for r in ps.error_summary(cells)}
    assert s[("in", "ar")]["max_abs_err"] == pytest.approx(0.3)
    assert s[("in", "ar")]["mean_abs_err"] == pytest.approx(0.2)
    assert s[("in", "ar")]["mean_err"] == pytest.approx(-0.1)
    assert (s[("in", "ar")]["inside_ci"], s[("in", "ar")]["with_ci"]) == (1, 2)
    assert s[("out", "sd")]["max_abs_err"] == pytest.approx(0.5) and s[("out", "sd")]["mean_abs_err"] == 0.35
    assert s[("out", "ssd")]["predicted"] == 0 and s[("out", "ssd")]["max_abs_err"] is None
    assert s[("out", "all")]["cells"] == 3 and s[("out", "all")]["max_abs_err"] == pytest.approx(0.5)
    assert math.isclose(s[("in", "all")]["mean_abs_err"], 0.2)


def test_cli_validate_split_and_update_doc(tmp_path, monkeypatch, capsys):
    from ssd_jax.cli import perfmodel as cli

    _two_files(tmp_path, heldout_ar=30.0)
    split = _split(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--validate-split", str(split)]) == 0
    assert "### Error summary" in capsys.readouterr().out
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- perfmodel:split -->\nold\n<!-- /perfmodel:split -->\nend\n")
    assert cli.main(["--update-doc", str(doc), "--validate-split", str(split)]) == 0
    text = doc.read_text()
    assert "old" not in text and "| out | batch > 1 |" in text and text.endswith("end\n")
