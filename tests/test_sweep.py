"""Resumable sweeps: grid expansion, one JSON line per configuration, resume after a kill, the report."""

import json

import pytest

from ssd_jax.bench import sweep
from ssd_jax.errors import UserError


def test_expand_drops_axes_a_method_ignores():
    cs = sweep.expand(
        {"method": ["ar", "sd", "ssd"], "k": [2, 4], "fan_out": ["geometric", 2], "category": ["code"]}
    )
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


@pytest.mark.slow  # 25-40 s; the sweep is an experiment tool, its pieces are tested above
def test_sweep_runs_resumes_and_reports(tiny_llama_path, tmp_path, monkeypatch):
    # a tiny random model as target and draft; prompts are real text, so give it a tokenizer-free path:
    # the sweep's prompts are replaced by token-id prompts
    import ssd_jax.data.prompts

    monkeypatch.setattr(
        ssd_jax.data.prompts,
        "load_prompts",
        lambda cat, n=None, **kw: [{"prompt": [1, 2, 3 + i]} for i in range(n)],
    )
    cfg = {
        "name": "tiny",
        "target": tiny_llama_path,
        "draft": tiny_llama_path,
        "new_tokens": 6,
        "n_prompts": 2,
        "grid": {"method": ["ar", "sd", "ssd"], "k": [2], "backup": ["neural"], "category": ["code"]},
    }
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


def _row(method, c=1.0, bs=1, hit=None, acc=0.5, **extra):
    cfg = {"method": method, "batch_size": bs, "temperature": 0.0, "category": "code"}
    if method == "ssd":
        cfg.update(k=4, fan_out="geometric", saguaro_c=c, backup="neural")
    row = {
        "config": cfg,
        "key": sweep.config_key(cfg),
        "prompts": 1,
        "decode_tokens_per_s": 10.0 * bs,
        "tokens_per_s_per_device": 5.0,
        "env": {"loadavg": [1.0, 1.0, 1.0], "backend": "cpu"},
        **extra,
    }
    if method != "ar":
        row.update(
            acceptance_rate=acc,
            mean_acceptance_length=2.0,
            draft_s=1.0,
            verify_s=2.0,
            sample_s=0.5,
            overhead_s=0.5,
        )
    if hit is not None:
        row.update(cache_hit_rate=hit, tau_hit=2.5, tau_miss=1.0, draft_exposed_s=0.25)
    return row


def test_report_time_breakdown_and_saguaro_plot(tmp_path):
    p = tmp_path / "s.jsonl"
    for r in [
        _row("ar"),
        _row("ar", bs=4),
        _row("sd", bs=4),
        _row("ssd", c=0.0, hit=0.9, acc=0.1),
        _row("ssd", c=1.0, hit=0.6, acc=0.5),
    ]:
        sweep.append_row(p, r)
    md, png = sweep.report(p)
    text = md.read_text()
    assert "## Time breakdown" in text
    # sd row: draft 1 of 4 s total = 25%, verify 50%; per-seq tok/s = 40 / 4 = 10
    assert "| method=sd batch_size=4 temperature=0.0 | code | 25% | 50% | 12% | 12% | - | 4.00 |" in text
    assert "| 40.00 | 10.00 | 1.00 |" in text
    assert (tmp_path / "s_hit_vs_acceptance.png").stat().st_size > 1000 and png.stat().st_size > 1000
    # a sweep without a C axis has no hit-vs-acceptance plot
    q = tmp_path / "t.jsonl"
    sweep.append_row(q, _row("ar"))
    sweep.report(q)
    assert not (tmp_path / "t_hit_vs_acceptance.png").exists()


def test_unknown_suite_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="unknown suite"):
        sweep.run_suite("nope", str(tmp_path))
    assert set(sweep.SUITES) >= {"smoke", "paper"}
    for s in sweep.SUITES.values():  # every built-in config is valid
        for cfg in s["sweeps"]:
            sweep.read_config(cfg)


def test_oracle_sweep_with_the_target_as_its_own_draft(tiny_llama_path, tmp_path, monkeypatch):
    # the target drafting for itself matches every greedy token: its rounds equal the oracle's
    monkeypatch.setattr(
        sweep, "category_prompts", lambda cat, n: [{"prompt": [1, 2, 3 + i], "id": i} for i in range(n)]
    )
    cfg = {
        "name": "orc",
        "kind": "oracle",
        "target": tiny_llama_path,
        "draft": tiny_llama_path,
        "k": 3,
        "new_tokens": 9,
        "n_prompts": 2,
        "categories": ["code"],
        "chat": False,
    }
    res = sweep.run_sweep(cfg, str(tmp_path))
    rows = sweep.read_results(res)
    assert [r["key"] for r in rows] == ["code/0", "code/1"]
    for r in rows:
        assert (
            r["methods"]["draft"]["rounds"] == r["methods"]["oracle"]["rounds"] == 3
        )  # 9 tokens, 4 per round
        assert r["methods"]["combine"]["rounds"] == 3
    md, png = sweep.report(res)
    assert png is None and "oracle" in md.read_text()
