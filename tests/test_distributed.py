"""SD and SSD across processes (``jax.distributed``), run through the local launcher: 2 processes x 2
fake CPU devices, the target mesh on process 0's devices and the draft mesh on process 1's."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from helpers import launch_cmd, launch_env, prompt_id_args, tokens

IDS = [[1, 2, 3], [4, 5, 6, 7, 8]]
N_NEW = 12


def start(*args):
    return subprocess.Popen(
        launch_cmd(*args, devices_per_process=2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launch_env(),
    )


def finish(p):
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out)


def launch(*args):
    return finish(start(*args))


def _args(target, draft, *extra):
    return [
        "--target",
        target,
        "--draft",
        draft,
        "--target-devices",
        "2",
        "--draft-devices",
        "2",
        *prompt_id_args(IDS),
        "--max-new-tokens",
        str(N_NEW),
        "--ignore-eos",
        "--json",
        "--k",
        "3",
        *extra,
    ]


@pytest.fixture(scope="module")
def models(tiny_llama_path, tiny_llama_draft_path):
    from ssd_jax import load_model

    return load_model(tiny_llama_path), load_model(tiny_llama_draft_path)


@pytest.fixture(scope="module")
def ar_tokens(models):
    from ssd_jax import SamplingParams, generate

    return tokens(generate(models[0], IDS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)))


# default set: sd (the ssd case is also run by test_launch_pinning and test_distributed_checkpoint)
@pytest.mark.parametrize("method", [pytest.param("ssd", marks=pytest.mark.slow), "sd"])
def test_greedy_across_processes_equals_single_process_ar(
    method, tiny_llama_path, tiny_llama_draft_path, ar_tokens
):
    # SSD with backup auto: the neural fallback and the host n-gram lookups both run across processes
    res = launch(
        *_args(
            tiny_llama_path,
            tiny_llama_draft_path,
            "--method",
            method,
            *(["--backup", "auto"] if method == "ssd" else []),
        )
    )
    assert tokens(res) == ar_tokens
    dev = res["metrics"]["devices"]
    assert (dev["processes"], dev["target_processes"], dev["draft_processes"]) == (2, [0], [1])


@pytest.mark.slow  # 35 s; the default set keeps greedy SSD across (pinned) processes equal to AR
def test_seeded_sampled_ssd_equals_the_single_process_run_and_merges_the_trace(
    models, tiny_llama_path, tiny_llama_draft_path, tmp_path
):
    """Same meshes, same keys, same programs; what crosses between processes is copied exactly, so the
    multi-process run draws the very tokens of the single-process one."""
    from ssd_jax import SamplingParams, SpecConfig, generate

    trace = tmp_path / "trace.json"
    sampled = ["--temperature", "1.0", "--top-k", "20", "--seed", "7", "--backup", "neural"]
    run = start(
        *_args(tiny_llama_path, tiny_llama_draft_path, "--method", "ssd", *sampled, "--trace", str(trace))
    )
    ref = generate(
        models[0],
        IDS,
        SamplingParams(temperature=1.0, top_k=20, seed=7, max_new_tokens=N_NEW, ignore_eos=True),
        spec=SpecConfig(
            method="ssd", draft=models[1], k=3, backup="neural", target_devices=2, draft_devices=2
        ),
    )
    res = finish(run)
    assert tokens(res) == tokens(ref)
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(lane.startswith("process 0 ") for lane in lanes) and any(
        lane.startswith("process 1 ") for lane in lanes
    )
    by_lane = {(e["cat"].split()[1], e["name"]) for e in events if e["ph"] == "X"}
    assert {("0", "verify"), ("1", "build"), ("1", "advance")} <= by_lane
    assert 0.0 <= res["metrics"]["overlap_fraction"] <= 1.0


@pytest.mark.parametrize(
    "no_kill",
    [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)],
    ids=["launcher-stops-the-rest", "survivor-notices"],
)
def test_killing_process_1_mid_run_ends_the_run_within_60_s(no_kill, tiny_llama_path, tiny_llama_draft_path):
    args = _args(tiny_llama_path, tiny_llama_draft_path, "--method", "ssd", "--backup", "neural")
    args[args.index("--max-new-tokens") + 1] = "480"
    p = subprocess.Popen(
        launch_cmd(*args, devices_per_process=2, no_kill=no_kill),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launch_env(),
    )  # survivor-notices: process 0 exits by itself (watchdog)
    try:
        pid1 = None
        for line in p.stderr:  # the pids, then the first move between the processes (mid-run)
            m = re.match(r"\[launch\] process 1 pid (\d+)", line)
            pid1 = int(m.group(1)) if m else pid1
            if "linked to process" in line:  # the bridge's link, at the first move (the prefill)
                break
        time.sleep(0.1)
        assert p.poll() is None, "the run ended before it could be interrupted"
        t = time.monotonic()
        os.kill(pid1, signal.SIGKILL)
        err = p.stderr.read()
        p.wait(timeout=90)
        took = time.monotonic() - t
    finally:
        if p.poll() is None:
            p.kill()
    assert took < 60, took
    assert p.returncode == 128 + signal.SIGKILL, err[-2000:]
    assert "[launch] process 1 was killed by SIGKILL" in err
    if no_kill:  # process 0 noticed by itself: one line, no traceback, no C++ stack trace
        # the watchdog's line, or (sooner) the link's: process 1's end of the connection closed
        assert (
            "[p0] error: process 0: process(es) 1 stopped responding" in err
            or "[p0] error: process 0: distributed run failed (a peer process may have died): RuntimeError: "
            "the peer process closed its link"
            in err
        ), err[-2000:]
        assert "Traceback" not in err and "Check failure" not in err


@pytest.mark.slow  # 15 s; the launcher test covers greedy SD on two meshes
def test_sd_on_two_meshes_in_one_process_draws_the_single_devicetokens(models):
    """The two-mesh SD round (draft call, target call, moves between) uses the keys of the fused round."""
    from ssd_jax import SamplingParams, SpecConfig, generate

    sp = SamplingParams(temperature=1.0, seed=3, max_new_tokens=N_NEW, ignore_eos=True)
    one = generate(models[0], IDS, sp, spec=SpecConfig(method="sd", draft=models[1], k=3))
    two = generate(
        models[0],
        IDS,
        sp,
        spec=SpecConfig(method="sd", draft=models[1], k=3, target_devices=2, draft_devices=2),
    )
    assert tokens(two) == tokens(one)
    assert two.metrics["calls_per_round"] == 2 and two.metrics["devices"]["draft"] == 2
