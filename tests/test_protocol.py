"""The benchmark protocol: its statistics on known inputs, the interleaving order, resume, and a
tiny end-to-end run (AR, SD, n-gram SD and SSD on tiny random models, seconds)."""

import json
import math

import pytest

from ssd_jax.bench import protocol
from ssd_jax.bench.stats import clustered, mean_ci, ratio_ci, t975
from ssd_jax.errors import UserError


def test_t_quantile_table_and_expansion():
    assert t975(1) == pytest.approx(12.7062, abs=1e-4)
    assert t975(4) == pytest.approx(2.7764, abs=1e-4)
    assert t975(31) == pytest.approx(2.0395, abs=1e-4)
    assert t975(100) == pytest.approx(1.9840, abs=1e-4)
    assert t975(10**6) == pytest.approx(1.96, abs=1e-3)
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 7, 30, 31, 45, 120, 1000):
        assert t975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=1e-4)


def test_mean_ci_known_interval():
    m, lo, hi = mean_ci([1, 2, 3, 4, 5])  # sd = sqrt(2.5), se = sqrt(0.5), t(4) = 2.7764
    assert (m, lo, hi) == pytest.approx(
        (3.0, 3 - 2.7764 * math.sqrt(0.5), 3 + 2.7764 * math.sqrt(0.5)), abs=1e-4
    )
    assert (m, lo, hi) == pytest.approx((3.0, 1.03679, 4.96321), abs=1e-4)
    assert mean_ci([7.0])[0] == 7.0 and math.isnan(mean_ci([7.0])[1])
    assert all(math.isnan(x) for x in mean_ci([]))


def test_ratio_ci_is_a_t_interval_on_log_ratios():
    assert ratio_ci([2.0, 2.0, 2.0]) == pytest.approx((2.0, 2.0, 2.0))
    g, lo, hi = ratio_ci([1.0, 4.0])  # logs 0 and ln 4: mean ln 2, se ln 2 (sd ln4/sqrt2 over sqrt 2), t(1)
    assert g == pytest.approx(2.0)
    assert lo == pytest.approx(math.exp(math.log(2) - 12.7062 * math.log(2)), rel=1e-4)
    assert hi == pytest.approx(math.exp(math.log(2) + 12.7062 * math.log(2)), rel=1e-4)
    g, lo, hi = ratio_ci([0.5, 2.0, 1.0])  # symmetric in log space: geometric mean 1, interval mirrored
    assert g == pytest.approx(1.0) and lo * hi == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ratio_ci([1.0, 0.0])


def test_clustered_averages_repeats_per_prompt():
    assert sorted(clustered([("a", 1.0), ("a", 3.0), ("b", 10.0)])) == [2.0, 10.0]
    assert sorted(clustered([("a", 1.0), ("a", 4.0), ("b", 3.0)], log=True)) == pytest.approx([2.0, 3.0])


def test_rotated_order_puts_every_method_everywhere():
    ms = ["ar", "sd", "ngram"]
    orders = [protocol.run_order(ms, pos, 0) for pos in range(3)]
    assert orders == [["ar", "sd", "ngram"], ["sd", "ngram", "ar"], ["ngram", "ar", "sd"]]
    for place in range(3):
        assert sorted(o[place] for o in orders) == sorted(ms)
    assert protocol.run_order(ms, 0, 1) == orders[1]  # the next repeat shifts again
    sh = protocol.run_order(ms, 4, 2, "shuffle", seed=3)
    assert sorted(sh) == sorted(ms) and sh == protocol.run_order(ms, 4, 2, "shuffle", seed=3)


def _units(n=2, batch=1):
    recs = {c: [{"id": f"{c}{i}", "prompt": [3 + i, 4, 5]} for i in range(4)] for c in ("code", "chat")}
    return protocol.build_units(recs, n, batch)


def test_units_alternate_categories_and_cycle_at_batch_sizes():
    us = _units(2)
    assert [(u.category, u.index) for u in us] == [("code", 0), ("chat", 0), ("code", 1), ("chat", 1)]
    big = _units(2, batch=6)
    assert len(big[0].prompts) == 6 and big[0].ident.split("+")[4] == "code0"  # wraps around the 4 records
    two = _units(2, batch=2)  # enough records: the units' batches are disjoint
    assert [u.ident for u in two] == ["code0+code1", "chat0+chat1", "code2+code3", "chat2+chat3"]


class Fake:
    """A runner at a fixed speed that counts its calls."""

    def __init__(self, tok_s, log):
        self.tok_s, self.log = tok_s, log

    def __call__(self, prompts, new_tokens):
        self.log.append(self.tok_s)
        return {
            "generated_tokens": new_tokens,
            "wall_s": new_tokens / self.tok_s,
            "ttft_s": 0.0,
            "decode_tok_s": self.tok_s,
            "e2e_tok_s": self.tok_s / 2,
            "token_ids": [[1] * new_tokens],
        }


def test_resume_skips_finished_runs_and_ratios_come_out_exact(tmp_path):
    log = []
    runners = {"ar": Fake(10.0, log), "fast": Fake(20.0, log)}
    path = tmp_path / "p.jsonl"
    protocol.run_protocol(runners, _units(), path, repeats=2, new_tokens=4, progress=False)
    assert len(log) == 2 * 2 * 4 + 2  # 2 methods x 4 units x 2 repeats, plus one warm-up each
    lines = path.read_text().splitlines()
    runs = [json.loads(x) for x in lines if '"run"' in x]
    assert len(runs) == 16 and {r["position"] for r in runs} == {0, 1}
    log.clear()
    protocol.run_protocol(runners, _units(), path, repeats=2, new_tokens=4, progress=False)
    assert log == []  # all done: nothing runs, not even the warm-up
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])  # lose the last run, tear the line
    protocol.run_protocol(runners, _units(), path, repeats=2, new_tokens=4, progress=False)
    assert len(log) == 1 + 2
    s = {(x["category"], x["method"]): x for x in protocol.summarize(protocol.read_rows(path))}
    assert s[("all", "fast")]["decode_tok_s_vs_base"] == pytest.approx((2.0, 2.0, 2.0))
    assert s[("code", "fast")]["prompts"] == 2 and s[("code", "fast")]["repeats"] == 2
    assert s[("all", "fast")]["same_tokens_as_ar"] == 1.0
    with pytest.raises(protocol.UserError, match="new tokens"):
        protocol.run_protocol(runners, _units(), path, repeats=3, new_tokens=5, progress=False)
    other = {"code": [{"id": "x", "prompt": [9]}] * 4, "chat": [{"id": "y", "prompt": [9]}] * 4}
    with pytest.raises(protocol.UserError):
        protocol.run_protocol(
            runners, protocol.build_units(other, 2, 1), path, repeats=3, new_tokens=4, progress=False
        )


@pytest.mark.slow  # ~20 s; by default test_cli_suite_protocol_on_a_tiny_checkpoint runs the suite end to end
def test_tiny_end_to_end_protocol(tmp_path, pair):
    target, draft = pair
    specs = protocol.method_specs(["ar", "sd:2", "ngram:2", "ssd:2"], draft)
    runners = {n: protocol.EngineRunner(target, s) for n, s in specs.items()}
    recs = {
        "code": [{"id": "a", "prompt": [3, 17, 29, 3, 17]}, {"id": "b", "prompt": [5, 6, 7, 5, 6, 7]}],
        "copy": [{"id": "c", "prompt": [90, 91, 92, 90, 91]}, {"id": "d", "prompt": [77, 78]}],
    }
    path = protocol.run_protocol(
        runners,
        protocol.build_units(recs, 2, 1),
        tmp_path / "tiny.jsonl",
        repeats=2,
        new_tokens=8,
        progress=False,
        env_extra={"roofline_ar_tok_s_per_row": protocol.ar_roofline(target.cfg, 10.0)},
    )
    rows = protocol.read_rows(path)
    assert len([r for r in rows if r["kind"] == "run"]) == 4 * 4 * 2
    summ = protocol.summarize(rows)
    for s in summ:
        assert s["same_tokens_as_ar"] == 1.0, s  # greedy speculation reproduces AR exactly
        assert s["decode_tok_s"][0] > 0
    md = protocol.write_report(path).read_text()
    assert "| 1 | all | sd-k2 | 4 x 2 |" in md and "vs ar" in md


def test_cli_rerenders_a_protocol_file(tmp_path):
    from ssd_jax.cli.bench import main

    log = []
    path = protocol.run_protocol(
        {"ar": Fake(10.0, log), "x": Fake(5.0, log)},
        _units(),
        tmp_path / "r.jsonl",
        repeats=1,
        new_tokens=2,
        progress=False,
    )
    path.with_suffix(".md").unlink(missing_ok=True)
    assert main(["--protocol-report", str(path)]) == 0
    assert "0.50x [0.50, 0.50]" in path.with_suffix(".md").read_text()


def test_cli_suite_protocol_on_a_tiny_checkpoint(tmp_path, tiny_llama_path, monkeypatch):
    """``--suite protocol`` end to end (batch 1 and 2) on a tokenizer-free tiny checkpoint: token-id prompts."""
    from ssd_jax.cli.bench import main

    monkeypatch.setattr(
        protocol,
        "category_prompts",
        lambda c, n: [{"id": f"{c}{i}", "prompt": [3 + i, 9, 11, 3 + i, 9]} for i in range(n)],
    )
    rc = main(
        [
            "--suite",
            "protocol",
            "--target",
            tiny_llama_path,
            "--methods",
            "ar",
            "ngram:2",
            "--categories",
            "code",
            "copy",
            "--n-prompts",
            "2",
            "--repeats",
            "1",
            "--batch-sizes",
            "1",
            "2",
            "--new-tokens",
            "6",
            "--bandwidth",
            "10",
            "--out",
            str(tmp_path),
            "--tag",
            "tiny",
        ]
    )
    assert rc == 0
    rows = protocol.read_rows(next(tmp_path.glob("protocol_*_tiny.jsonl")))
    runs = [r for r in rows if r["kind"] == "run"]
    assert len(runs) == 2 * 2 * 2 * 2 and {r["batch_size"] for r in runs} == {1, 2}
    assert all(r["generated_tokens"] == 6 * r["batch_size"] for r in runs)
    env = [r for r in rows if r["kind"] == "env"][0]
    assert env["bandwidth_gb_s"] == 10 and env["roofline_ar_tok_s_per_row"] > 0 and env["git_commit"]
    md = next(tmp_path.glob("protocol_*_tiny.md")).read_text()
    assert "| 2 | all | ngram-k2 | 4 x 1 |" in md and "| 1 | copy | ar | 2 x 1 |" in md


def test_method_names_parse_auto_k_and_vocabulary_trimming():
    specs = protocol.method_specs(["ar", "sd:auto", "ngram:3", "ssd:2:v64", "sd"], draft="d")
    assert specs["sd-kauto"].k == "auto" and specs["ngram-k3"].k == 3 and specs["sd-k4"].k == 4
    assert specs["ssd-k2-v64"].draft_vocab == 64 and specs["ssd-k2-v64"].method == "ssd"
    for bad in ("sd:x", "sd:4:64", "ngram:4:v8", "sd:4:v8:z"):
        with pytest.raises(UserError):
            protocol.method_specs(["ar", bad], draft="d")
