"""Draft evaluation tooling on tiny random models: the SDSL validation under the protocol (train,
skip finished runs, interleaved measurement of several drafts, report and verdict), acceptance
by position and category, and the learning curve from ``--keep-evals`` snapshots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_distill import PROMPTS, _heldout
from test_train import save_tiny_target

from ssd_jax import training as T
from ssd_jax.bench import acceptance, learning_curve, protocol
from ssd_jax.bench import sdsl_validation as sv
from ssd_jax.errors import UserError
from ssd_jax.loading import load_model
from ssd_jax.training import distill_data as DD

RECORDS = {
    "code": [{"id": "c0", "prompt": "hello world"}, {"id": "c1", "prompt": "the lazy dog"}],
    "chat": [{"id": "h0", "prompt": "quick brown fox"}, {"id": "h1", "prompt": "jumps over again"}],
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-eval")
    save_tiny_target(root, "ef")
    target = load_model(root / "target")
    rec = DD.DistillRecipe(
        target=str(root / "target"),
        n_prompts=6,
        temperatures=(0.0,),
        top_k=8,
        max_new_tokens=8,
        max_prompt_tokens=16,
        batch_size=3,
        shard_prompts=3,
    )
    DD.build_distill_data(rec, root / "data", target=target, prompts=PROMPTS)
    return root, target


# --- acceptance by position ----------------------------------------------------------------------------
def test_round_stats_by_position():
    s = acceptance.round_stats([0, 4, 2, 1, 4], drafted=20, k=4)
    assert s["at_least"] == [0.8, 0.6, 0.4, 0.4] and s["histogram"] == [1, 1, 1, 0, 2]
    assert s["acceptance"] == 11 / 20 and s["tokens_per_round"] == (11 + 5) / 5
    assert s["conditional"] == pytest.approx([0.8, 0.75, 2 / 3, 1.0])
    # the accepted count is the sum over positions of the rounds reaching them
    assert sum(s["at_least"]) * s["rounds"] == pytest.approx(s["accepted"])


def test_acceptance_measure_on_a_tiny_pair(pair):
    """The draft is the target itself: every proposal is accepted at T = 0 and at T = 1 (q = p)."""
    target, _ = pair
    recs = {
        "code": [{"id": "a", "prompt": [3, 17, 29, 3, 17]}],
        "chat": [{"id": "b", "prompt": [5, 6, 7, 8, 9]}],
    }
    res = acceptance.measure(target, target, recs, temperatures=(0.0, 1.0), ks=(3,), new_tokens=6, chat=False)
    assert {(c["temperature"], c["category"]) for c in res["cells"]} == {
        (t, c) for t in (0.0, 1.0) for c in ("code", "chat", "all")
    }
    for c in res["cells"]:
        assert c["rounds"] > 0 and c["acceptance"] == 1.0 and c["at_least"] == [1.0] * 3
        assert c["drafted"] == c["accepted"] and c["histogram"][3] == c["rounds"]
    md = acceptance.render(res)
    assert "| 3 | 1 | all |" in md and ">= 3" in md


@pytest.mark.slow
def test_cli_suite_acceptance(tmp_path, tiny_llama_path, tiny_llama_draft_path, monkeypatch):
    from ssd_jax.cli.bench import main

    monkeypatch.setattr(
        protocol,
        "category_prompts",
        lambda c, n: [{"id": f"{c}{i}", "prompt": [3 + i, 9, 11, 3 + i, 9]} for i in range(n)],
    )
    rc = main(
        [
            "--suite",
            "acceptance",
            "--target",
            tiny_llama_path,
            "--draft",
            tiny_llama_draft_path,
            "--categories",
            "code",
            "copy",
            "--n-prompts",
            "2",
            "--new-tokens",
            "6",
            "--out",
            str(tmp_path),
            "--tag",
            "tiny",
        ]
    )
    assert rc == 0
    res = json.loads(next(tmp_path.glob("acceptance_*_tiny.json")).read_text())
    assert {(c["k"], c["temperature"], c["category"]) for c in res["cells"]} == {
        (4, t, c) for t in (0.0, 1.0) for c in ("code", "copy", "all")
    }
    assert (
        res["env"]["git_commit"]
        and "| 4 | 0 | all | 4 |" in next(tmp_path.glob("acceptance_*_tiny.md")).read_text()
    )


# --- the protocol with several drafts ---------------------------------------------------------------------
def test_methods_take_their_own_draft():
    loaded = []
    specs = protocol.method_specs(
        ["ar", "sd:auto@runs/L1-s0", "sd:2:v64@runs/L3-s0/", "ssd:4"],
        draft="d",
        load_draft=lambda ref: loaded.append(ref) or f"model:{ref}",
    )
    assert specs["sd-kauto@L1-s0"].draft == "model:runs/L1-s0" and specs["sd-k2-v64@L3-s0"].draft_vocab == 64
    assert specs["ssd-k4"].draft == "d" and loaded == ["runs/L1-s0", "runs/L3-s0/"]
    for bad in (["ar", "ngram:2@x"], ["ar", "sd:2@"], ["ar", "sd:2@a/x", "sd:3@b/x"]):
        with pytest.raises(UserError):
            protocol.method_specs(bad, load_draft=str)


# --- SDSL validation -------------------------------------------------------------------------------------
def test_law_depths_bracket_the_optimum():
    from ssd_jax.models.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        tie_embeddings=True,
    )  # SmolLM2-135M
    d, depths = sv.law_depths(cfg)
    assert d == 3 and depths == [1, 2, 3, 4, 6]
    from ssd_jax.training.draft_model import size_draft

    assert [size_draft(cfg, sv.size_of_depth(cfg, x))[0].num_layers for x in depths] == depths
    small = cfg.replace(num_layers=2)
    assert len(sv.law_depths(small)[1]) >= 4


def _size(depth, m, lo, hi, n=1e6):
    return {"depth": depth, "N": n * depth, "sd_vs_ar": (m, lo, hi)}


def test_verdict_reads_the_intervals():
    resolved = [_size(1, 0.8, 0.7, 0.9), _size(2, 1.2, 1.1, 1.3), _size(3, 0.9, 0.85, 1.0)]
    v = sv.verdict(resolved, n_opt=2e6)
    assert v.startswith("The optimum is resolved at 2 layers") and "which is the measured best" in v
    assert "Faster than AR (interval above 1): 2 layers" in v
    overlap = [_size(1, 0.8, 0.7, 0.9), _size(2, 1.0, 0.9, 1.1), _size(3, 0.95, 0.88, 1.02)]
    v = sv.verdict(overlap, n_opt=1e6)
    assert v.startswith("The optimum is NOT resolved") and "3 layers" in v and "not the measured best" in v
    overlap[1].update(next_vs_this=(0.95, 0.93, 0.97), next_depth=3)  # paired: size 3 / size 2
    assert "the best size runs at 1.053x [1.031, 1.075] over 3 layers (excludes 1)" in sv.verdict(overlap)
    edge = [_size(1, 0.5, 0.4, 0.6), _size(2, 0.7, 0.65, 0.75), _size(3, 0.9, 0.85, 0.95)]
    v = sv.verdict(edge)
    assert "NOT bracketed" in v and "largest" in v and "Every size is slower than AR" in v
    assert "cannot be judged" in sv.verdict(
        [_size(1, 0.5, math.nan, math.nan), _size(2, 0.6, math.nan, math.nan)]
    )


def _validation(root, tmp_path, **kw) -> sv.Validation:
    base = dict(
        target=str(root / "target"),
        data=str(root / "data"),
        runs=str(tmp_path / "runs"),
        out=str(tmp_path / "out"),
        depths=(1,),
        seeds=(0, 1),
        steps=1,
        batch_size=2,
        seq_len=32,
        lr=3e-3,
        eval_every=1,
        eval_windows=2,
        k=2,
        categories=("code",),
        n_prompts=2,
        repeats=1,
        new_tokens=3,
    )
    return sv.Validation(**{**base, **kw})


def _check_validation(v: sv.Validation, target, root, md) -> list[dict]:
    out = Path(v.out)
    assert {p.name for p in out.iterdir()} >= {
        "sdsl.md",
        "summary.json",
        "sdsl.png",
        "protocol.jsonl",
        "protocol.md",
        "drafts.json",
    }
    names = [sv.run_name(d, s) for d in v.depths for s in v.seeds]
    runs = [r for r in protocol.read_rows(out / "protocol.jsonl") if r["kind"] == "run"]
    assert {r["method"] for r in runs} == {"ar", *(f"sd-k{v.k}@{n}" for n in names)}
    assert len(runs) == (1 + len(names)) * len(v.categories) * v.n_prompts * v.repeats
    by = {}
    for r in runs:  # greedy SD with every draft emits AR's tokens
        by.setdefault((r["category"], r["prompt_index"], r["repeat"]), set()).add(r["tokens_sha"])
    assert all(len(s) == 1 for s in by.values())
    summ = json.loads((out / "summary.json").read_text())
    assert [s["depth"] for s in summ["sizes"]] == list(v.depths)
    assert all(s["seeds"] == list(v.seeds) for s in summ["sizes"])
    for s in summ["sizes"]:
        m, lo, hi = s["sd_vs_ar"]
        assert lo <= m <= hi and s["law_sd_vs_ar"] is not None and 0 <= s["acceptance"] <= 1
    text = md.read_text()
    assert summ["verdict"] in text and "law SD/AR (N)" in text
    assert (
        f"| {names[-1]} | {v.depths[-1]} | {v.seeds[-1]} | {v.n_prompts * v.repeats * len(v.categories)} |"
        in text
    )
    # a rerun trains nothing and runs nothing more
    logs = []
    sv.validate(v, target.cfg, corpus=_heldout(root), records=RECORDS, log=logs.append)
    assert logs == [f"{n}: finished, skipped" for n in names]
    assert len([r for r in protocol.read_rows(out / "protocol.jsonl") if r["kind"] == "run"]) == len(runs)
    return runs


@pytest.mark.slow
def test_validation_trains_measures_reports_and_skips_finished_runs(env, tmp_path):
    """Two seeds of one size (~30 s: 2 trainings, 2 drafts compiled); 2 sizes x 2 seeds is the next test."""
    root, target = env
    v = _validation(root, tmp_path)
    md = sv.validate(v, target.cfg, corpus=_heldout(root), records=RECORDS, log=lambda m: None)
    _check_validation(v, target, root, md)
    summ = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "fewer than two sizes" in summ["verdict"]
    # the CLI re-renders the report from the files
    from ssd_jax.cli import sdsl as sdsl_cli

    (tmp_path / "out" / "sdsl.md").unlink()
    rc = sdsl_cli.main(
        [
            "validate",
            "--target",
            v.target,
            "--data",
            v.data,
            "--runs",
            v.runs,
            "--out",
            v.out,
            "--sizes",
            "1L",
            "--steps",
            "1",
            "--k",
            "2",
            "--categories",
            "code",
            "--n-prompts",
            "2",
            "--repeats",
            "1",
            "--new-tokens",
            "3",
            "--report-only",
        ]
    )
    assert rc == 0 and summ["verdict"] in (tmp_path / "out" / "sdsl.md").read_text()


@pytest.mark.slow
def test_validation_of_two_sizes_two_seeds(env, tmp_path):
    root, target = env
    v = _validation(
        root,
        tmp_path,
        depths=(1, 2),
        steps=2,
        eval_every=2,
        categories=("code", "chat"),
        repeats=2,
        new_tokens=4,
        draft_vocab=64,
    )
    md = sv.validate(v, target.cfg, corpus=_heldout(root), records=RECORDS, log=lambda m: None)
    _check_validation(v, target, root, md)
    from ssd_jax.loading.draft import trained_head_vocab

    # every draft trained its trimmed head (the shipped draft's recipe) and is measured with it
    heads = [
        trained_head_vocab(Path(v.runs) / sv.run_name(d, s) / "best" / "params")
        for d in v.depths
        for s in v.seeds
    ]
    assert [h and h[0] for h in heads] == [64] * 4
    summ = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summ["verdict"].startswith("The optimum is")


def test_summary_and_report_from_protocol_rows(tmp_path):
    """The per-size statistics pool seeds per prompt; the law column uses the measured acceptance and K."""
    drafts = [
        {
            "name": sv.run_name(d, s),
            "depth": d,
            "seed": s,
            "N": 1e6 * d,
            "reads_per_token": 3e6 + 1e6 * d,
            "M": 1e7,
            "n_opt_law": 2e6,
            "best": {"alpha": 0.3, "step": 4},
            "path": f"runs/L{d}-s{s}",
        }
        for d in (1, 2, 3)
        for s in (0, 1)
    ]
    v = sv.Validation(
        target="t",
        data="d",
        runs="runs",
        out=str(tmp_path),
        k=4,
        categories=("code",),
        n_prompts=3,
        repeats=2,
    )
    speed = {1: 0.8, 2: 1.2, 3: 0.9}
    rows = [{"kind": "env", "loadavg": [1.0, 1.0, 1.0], "jax": "x", "config": {}}]
    for p in range(3):
        for r in range(2):
            noise = 1 + 0.01 * (p - 1) + 0.005 * r
            rows.append(
                {
                    "kind": "run",
                    "batch_size": 1,
                    "category": "code",
                    "prompt_index": p,
                    "repeat": r,
                    "method": "ar",
                    "decode_tok_s": 10.0,
                }
            )
            for d in drafts:
                rows.append(
                    {
                        "kind": "run",
                        "batch_size": 1,
                        "category": "code",
                        "prompt_index": p,
                        "repeat": r,
                        "method": sv.method_name(v, d),
                        "decode_tok_s": 10.0 * speed[d["depth"]] * noise,
                        "acceptance_rate": 0.1 * d["depth"],
                        "tokens_per_round": 1.5,
                        "k": 4,
                    }
                )
    summ = sv.summarize(v, drafts, rows)
    s2 = summ["sizes"][1]
    assert s2["seeds"] == [0, 1] and s2["sd_vs_ar"][0] == pytest.approx(1.2 * (1 + 0.0025), rel=1e-3)
    assert s2["law_sd_vs_ar"] == pytest.approx(float(sv.sdsl.speedup(0.2, 4, 2e6, 1e7)))
    assert summ["sizes"][0]["next_vs_this"] == pytest.approx((1.5, 1.5, 1.5)) and s2["next_depth"] == 3
    assert (
        summ["verdict"].startswith("The optimum is resolved at 2 layers")
        and "the measured best" in summ["verdict"]
    )
    md = sv.render(v, summ, rows)
    assert (
        "| 2 | 2.00M | 0.50 | 0, 1 | 1.20x [" in md
        and "| 0.75x [0.75, 0.75] | 0.200 |" in md
        and summ["verdict"] in md
        and "| L3-s1 | 3 | 1 | 6 |" in md
    )
    assert sv.plot(summ, tmp_path / "p.png").stat().st_size > 0


# --- learning curve --------------------------------------------------------------------------------------
def test_learning_curve_from_the_training_evaluations(tmp_path):
    """A run without --keep-evals: the curve is its evaluations, the tokens from its log (no model loaded)."""
    from ssd_jax.cli import train as train_cli
    from ssd_jax.loading import draft as dfmt

    run = tmp_path / "run"
    run.mkdir()
    evals = [{"step": s, "alpha": 0.2 + 0.1 * s, "greedy_match": 0.1 * s, "ppl": 50.0 - s} for s in (0, 2, 4)]
    dfmt.write_json_atomic(
        run / dfmt.DRAFT_META,
        {
            "format": dfmt.FORMAT,
            "format_version": dfmt.FORMAT_VERSION,
            "step": 4,
            "evals": evals,
            "train": {"args": {"batch_size": 2, "seq_len": 8, "loss": "distill"}},
        },
    )
    (run / "train_log.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0, "tokens": 10.0}) + "\n" for s in range(1, 5))
    )
    assert train_cli.main(["learning-curve", str(run), "--out", str(tmp_path / "lc")]) == 0
    c = json.loads((tmp_path / "lc" / "learning_curve.json").read_text())["curves"][0]
    assert [(p["step"], p["window_tokens"], p["loss_tokens"]) for p in c["points"]] == [
        (0, 0, 0.0),
        (2, 32, 20.0),
        (4, 64, 40.0),
    ]
    assert [p["greedy_match"] for p in c["points"]] == [0.0, 0.2, 0.4] and all(
        p["sd"] is None for p in c["points"]
    )
    md = (tmp_path / "lc" / "learning_curve.md").read_text()
    assert "| 4 | 64 | 40 | 0.600 | 0.400 | 46.0 | - | - |" in md
    assert (tmp_path / "lc" / "learning_curve.png").stat().st_size > 0


@pytest.mark.slow
def test_learning_curve_from_kept_eval_drafts(env, tmp_path):
    root, target = env
    args = T.TrainArgs(
        target=str(root / "target"),
        size="40K",
        steps=2,
        batch_size=2,
        seq_len=32,
        lr=3e-3,
        warmup=1,
        eval_every=1,
        eval_windows=2,
        loss="distill",
        ce_weight=0.25,
        data=str(root / "data"),
        out=str(tmp_path / "run"),
        keep_evals=True,
    )
    T.train(args, corpus=_heldout(root))
    assert sorted(learning_curve.snapshots(tmp_path / "run")) == [0, 1, 2]
    recs = {"code": RECORDS["code"][:1]}
    logs = []
    md = learning_curve.write(
        [tmp_path / "run"], tmp_path / "lc", target=target, records=recs, k=4, new_tokens=6, log=logs.append
    )
    assert len(logs) == 3
    c = json.loads((tmp_path / "lc" / "learning_curve.json").read_text())["curves"][0]
    assert [p["step"] for p in c["points"]] == [0, 1, 2]
    assert [p["window_tokens"] for p in c["points"]] == [0, 64, 128]
    assert all(p["sd"]["k"] == 4 and 0 <= p["sd"]["acceptance"] <= 1 for p in c["points"])
    assert c["points"][2]["loss_tokens"] > c["points"][1]["loss_tokens"] > 0
    assert (tmp_path / "lc" / "learning_curve.png").stat().st_size > 0 and "| 2 | 128 |" in md.read_text()
    logs.clear()
    learning_curve.write(
        [tmp_path / "run"], tmp_path / "lc", target=target, records=recs, k=4, new_tokens=6, log=logs.append
    )
    assert logs == []  # measured snapshots are reused
    # without snapshots (a run without --keep-evals): the training evaluations only
    from ssd_jax.cli import train as train_cli

    assert (
        train_cli.main(["learning-curve", str(tmp_path / "run"), "--out", str(tmp_path / "lc2"), "--no-sd"])
        == 0
    )
    c2 = json.loads((tmp_path / "lc2" / "learning_curve.json").read_text())["curves"][0]
    assert all(p["sd"] is None and p["greedy_match"] is not None for p in c2["points"])
    assert np.isfinite([p["alpha_t1"] for p in c2["points"]]).all()
