"""tools/gpu_check.py cannot rot: its --smoke mode (the GPU script's code path end to end, on
CPU with tiny shapes) runs here, its tables render from known results, and its full-size model shapes
are Qwen2.5-1.5B's and 0.5B's.

The default set runs the short smoke (``--only build,device,cmdbuf,roundcost``: the driver, its report,
and the steps whose code only this script has, about 25 s); the whole smoke (the engine and exactness
steps too, about 50 s) is in the slow set, which CI runs. The engine step's property, every loop giving
AR's tokens at T = 0, is the default set's in test_engine.py, test_sd.py and test_ssd.py; the exactness
step's, numerics and the goodness of fit with its control, in test_verify.py and test_exactness.py."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_full_shapes_have_qwen_parameter_counts():
    gc = _module()
    count = lambda shape: sum(math.prod(s) for _, s, _ in gc.tensor_shapes(shape))
    assert abs(count(gc.QWEN_15B) - 1.544e9) < 0.01e9  # Qwen2.5-1.5B: 1.54B parameters (tied head)
    assert abs(count(gc.QWEN_05B) - 0.494e9) < 0.01e9  # Qwen2.5-0.5B: 0.49B


def test_results_name_the_commit_and_jax():
    gc = _module()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    want = head.stdout.strip() if head.returncode == 0 else "unknown"
    assert gc.commit().split("+")[0] == want
    import jax

    assert gc.jax_version() == jax.__version__


def _smoke(tmp_path, *flags) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--smoke",
        "--out",
        str(tmp_path / "out"),
        "--work",
        str(tmp_path / "work"),
    ]
    p = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    log_file = tmp_path / "out" / "gpu_check.log"
    log = log_file.read_text() if log_file.exists() else ""
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + log[-3000:]
    return json.loads((tmp_path / "out" / "gpu_check.json").read_text())


def test_short_smoke_runs_the_steps_only_this_script_has(tmp_path):
    res = _smoke(tmp_path, "--only", "build,device,cmdbuf,roundcost")
    ran = {k for k, s in res["steps"].items() if s["status"] == "ok"}
    assert ran == {"build", "device", "cmdbuf", "roundcost"}
    assert {s["status"] for k, s in res["steps"].items() if k not in ran} == {"skipped: not in --only"}
    assert res["smoke"] and res["commit"].split("+")[0] == _module().commit().split("+")[0]
    assert res["steps"]["device"]["result"]["bandwidth_gb_s"]["read (sum)"] > 0
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "smoke run" in md and "## Round cost" in md


def test_only_names_steps_it_has(tmp_path):
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--only", "build,nope", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode != 0 and "--only build,nope: steps are" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow  # ~50 s: the engine and exactness steps too (their library paths: see the docstring)
def test_smoke_run_end_to_end(tmp_path):
    res = _smoke(tmp_path)
    assert res["smoke"] and set(res["steps"]) == {
        "build",
        "device",
        "engine",
        "exactness",
        "cmdbuf",
        "roundcost",
    }
    assert (
        res["commit"].split("+")[0] == _module().commit().split("+")[0]
        and res["jax"] == _module().jax_version()
    )
    assert "--xla_backend_optimization_level=0" in res["xla_flags"]  # the smoke run's, as the engine saw them
    assert all(s["status"] == "ok" for s in res["steps"].values())
    assert res["steps"]["device"]["result"]["bandwidth_gb_s"]["read (sum)"] > 0
    rows = {r["method"]: r for r in res["engine_rows"]}
    assert set(rows) == {
        "ar",
        "sd draft=target",
        "sd draft=unrelated",
        "ssd draft=target",
        "ssd draft=unrelated",
        "sd draft=unrelated, profiled stages",
        "ssd draft=unrelated, profiled stages",
    }
    assert all(r["same_tokens_as_ar"] for r in res["engine_rows"])  # greedy: every loop gives AR's tokens
    assert (
        rows["sd draft=target"]["acceptance_rate"] == 1.0
        and rows["ssd draft=target"]["acceptance_rate"] == 1.0
    )
    assert rows["ssd draft=target"]["calls_per_round"] == 1.0  # one device: the whole round is one call
    prof = rows["ssd draft=unrelated, profiled stages"]
    assert prof["verify_s_per_round"] > 0 and prof["draft_s_per_round"] > 0  # build against verify
    assert rows["sd draft=unrelated, profiled stages"]["overhead_s_per_round"] is not None
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "smoke run" in md and "## Exactness apart from numerics" in md and "## Round cost" in md
    _check_new_steps(res["steps"])


def _check_new_steps(steps):
    """The round-cost, command-buffer and exactness steps of a smoke run."""
    rc = steps["roundcost"]["result"]
    assert {r["method"] for r in rc["rows"]} == {"ar", "sd", "ssd"}
    assert all(r["round_ms"] > 0 and r["calls_per_round"] >= 1 for r in rc["rows"])
    assert any(r["profiled"] and r.get("verify_ms", 0) > 0 for r in rc["rows"])  # the stage split
    assert "| one | ssd |" in rc["table"]
    cb = steps["cmdbuf"]["result"]
    # the CPU build knows the GPU flag (else only the default run, said so): both runs, and the note
    assert set(cb["variants"]) == ({"default", "command buffers off"} if cb["flag_known"] else {"default"})
    assert "not applicable on cpu" in cb["note"] or "does not define" in cb["note"]
    for v in cb["variants"].values():
        assert v["rc"] == 0 and len(v["rows"]) == 1 and all(min(r["decode_tok_s"]) > 0 for r in v["rows"])
    off = cb["variants"].get("command buffers off")
    assert off is None or "--xla_gpu_enable_command_buffer=" in off["xla_flags"]
    ex = {r["dtype"]: r for r in steps["exactness"]["result"]["rows"]}
    assert set(ex) == {"float32", "bfloat16"}
    for dtype, r in ex.items():
        # greedy speculation gives AR's tokens; the T = 1 emissions fit; the biased redraw does not
        assert r["sd_mismatches"] == 0 and r["ssd_mismatches"] == 0, (dtype, r)
        assert r["gof"]["passed"] and r["gof_own_dtype"]["passed"] and not r["control"]["passed"], r
        assert r["gof"]["n"] > 100 and 0 < r["gof"]["acceptance"] < 1  # rejections happen
        assert r["min_top1_margin"] > 0 and r["margin_positions"] == r["greedy_tokens"]
        assert 0 <= r["argmax_agreement"] <= 1 and r["max_abs_diff"] >= 0
    assert ex["float32"]["max_abs_diff"] < 1e-3 and ex["float32"]["argmax_agreement"] == 1.0


def test_tables_render_the_new_steps():
    """The markdown of known results: the exactness, command-buffer and round-cost sections."""
    gc = _module()
    fit = dict(n=512, pooled_p=[0.5, 0.4], min_p=0.4, tests=6, alpha=1e-4, passed=True, outside_support=0)
    row = dict(
        dtype="bfloat16", k=2, positions=12, max_abs_diff=0.03, argmax_agreement=1.0, logit_std=4.0,
        min_top1_margin=0.02, margin_positions=48, margins_below_diff=1, greedy_tokens=48,
        sd_mismatches=0, ssd_mismatches=2, gof={**fit, "acceptance": 0.5}, gof_own_dtype=fit,
        control={**fit, "kind": "to_tail", "tv": 0.2, "min_p": 1e-9, "passed": False},
    )  # fmt: skip
    ar = {"model": "m", "decode_tok_s": [10.0, 12.0], "first_call_s": 1.0}
    cb = {"flag": "--f=", "flag_known": True, "note": "n", "variants": {"default": {"rows": [ar]}}}
    steps = {
        "exactness": {"status": "ok", "seconds": 1.0, "result": {"rows": [row]}},
        "cmdbuf": {"status": "ok", "seconds": 1.0, "result": cb},
        "roundcost": {"status": "ok", "seconds": 1.0, "result": {"table": "# Round cost: t\n\n| x |\n"}},
    }
    res = dict(status="s", smoke=True, total_s=1.0, budget_s=480.0, commit="c", jax="j", xla_flags="")
    md = gc.render({**res, "steps": steps, "engine_rows": []})
    assert "| bfloat16 | 0.03 | 1 | 4 | 0.02 | 1 of 48 | 0 / 2 (48) | 512 | 0.4, True | 0.4, True " in md
    assert "| (0.2) 1e-09, True |" in md
    assert "| default | m | 12.0 | 10.0, 12.0 | 1.0 |" in md and "## Round cost: t" in md
