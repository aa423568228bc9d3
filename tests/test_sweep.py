"""Resumable sweeps: grid expansion, one JSON line per configuration, resume after a kill, the report."""

import json

import pytest

from ssd_jax import sweep
from ssd_jax.errors import UserError


def test_expand_drops_axes_a_method_ignores():
    cs = sweep.expand({"method": ["ar", "sd", "ssd"], "k": [2, 4], "fan_out": ["geometric", 2], "category": ["code"]})
    assert sum(c["method"] == "ar" for c in cs) == 1  # AR has no K or fan-out
    assert sum(c["method"] == "sd" for c in cs) == 2
    assert sum(c["method"] == "ssd" for c in cs) == 4
    assert len({sweep.config_key(c) for c in cs}) == len(cs)


def test_torn_lines_are_skipped_and_appends_start_fresh(tmp_path):
    p = tmp_path / "r.jsonl"
    sweep.append_row(p, {"key": "a"})
    with open(p, "a") as f:
        f.write('{"key": "b", "tokens')  # a kill in the middle of a write
    sweep.append_row(p, {"key": "c"})
    assert [r["key"] for r in sweep.read_results(p)] == ["a", "c"]


def test_bad_configs(tmp_path):
    with pytest.raises(UserError, match="not found"):
        sweep.read_config(tmp_path / "none.json")
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"target": "x", "grid": {"methd": ["ar"]}}))
    with pytest.raises(UserError, match="unknown grid axes"):
        sweep.read_config(bad)
    bad.write_text(json.dumps({"target": "x", "grid": {"method": ["beam"]}}))
    with pytest.raises(UserError, match="unknown methods"):
        sweep.read_config(bad)


def test_sweep_runs_resumes_and_reports(tiny_llama_path, tmp_path, monkeypatch):
    # a tiny random model as target and draft; prompts are real text, so give it a tokenizer-free path:
    # the sweep's prompts are replaced by token-id prompts
    import ssd_jax.data

    monkeypatch.setattr(ssd_jax.data, "load_prompts", lambda cat, n=None, **kw: [{"prompt": [1, 2, 3 + i]} for i in range(n)])
    cfg = {"name": "tiny", "target": tiny_llama_path, "draft": tiny_llama_path, "new_tokens": 6, "n_prompts": 2,
           "grid": {"method": ["ar", "sd", "ssd"], "k": [2], "backup": ["neural"], "category": ["code"]}}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "res"
    res = sweep.run_sweep(str(path), str(out))
    rows = sweep.read_results(res)
    assert [r["config"]["method"] for r in rows] == ["ar", "sd", "ssd"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["prompts"] == 2
        assert {"jax", "backend", "device_kind", "git_commit", "models", "loadavg"} <= set(r["env"])
    assert rows[2]["cache_hit_rate"] == 1.0  # the draft is the target itself
    # resume: a finished sweep runs nothing; a dropped line is re-run
    lines = res.read_text().splitlines()
    res.write_text("\n".join(lines[:2]) + "\n")
    calls = []
    real = sweep.run_one
    monkeypatch.setattr(sweep, "run_one", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    sweep.run_sweep(str(path), str(out))
    assert [c["method"] for c in calls] == ["ssd"]
    md, png = sweep.report(res)
    assert "| method=ssd" in md.read_text() and png.stat().st_size > 1000
