"""tools/gpu_check.py cannot rot: its --smoke mode (the GPU script's code path end to end, on
CPU with tiny shapes) runs here, and its full-size model shapes are Qwen2.5-1.5B's and 0.5B's."""

import importlib.util
import json
import math
import os
import subprocess

import pytest
import sys
from pathlib import Path

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


# slow (default-suite budget, 22 s): run it before a GPU check (make test-slow or pytest -m slow)
@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--out",
            str(tmp_path / "out"),
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    log = (
        (tmp_path / "out" / "gpu_check.log").read_text()
        if (tmp_path / "out" / "gpu_check.log").exists()
        else ""
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + log[-3000:]
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert res["smoke"] and set(res["steps"]) == {"build", "device", "engine"}
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
    assert "smoke run" in (tmp_path / "out" / "gpu_check.md").read_text()
