"""Hardware of its own per process: ``python -m ssd_jax.launch --cpus-per-process N`` and ``SSD_JAX_CPUS``
(applied by ``ssd_jax.xla_env`` on import, before JAX starts). Process i gets a disjoint set of cores,
XLA's thread pool follows, and a run records the cores each process used."""

import json
import re
import subprocess
import sys

import pytest
from helpers import launch_cmd, launch_env, ssd_decode_args, tokens

from ssd_jax.cli.launch import assign_cpus
from ssd_jax.cli.launch import main as launch_main
from ssd_jax.errors import UserError
from ssd_jax.xla_env import CPUS_ENV, cpus, parse_cpus

IDS = [[1, 2, 3], [4, 5, 6, 7, 8]]
N_NEW = 12
AVAILABLE = cpus()
needs_two_cores = pytest.mark.skipif(
    len(AVAILABLE) < 2, reason=f"needs 2 usable cores to give each process its own; this one has {AVAILABLE}"
)


def test_core_lists_parse():
    assert parse_cpus("0") == [0]
    assert parse_cpus("3,1") == [1, 3]
    assert parse_cpus("0-2,5, 1") == [0, 1, 2, 5]
    for bad in ("", "a", "2-1", "-1", ","):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_processes_get_disjoint_cores_and_too_many_are_refused():
    assert assign_cpus(2, 1, [0, 1]) == [[0], [1]]
    assert assign_cpus(2, 2, [7, 1, 3, 5, 0]) == [[0, 1], [3, 5]]  # sorted, in order, the rest unused
    assert assign_cpus(1, 2, [4, 6]) == [[4, 6]]
    sets = assign_cpus(3, 2, range(8))
    assert all(not set(a) & set(b) for i, a in enumerate(sets) for b in sets[i + 1 :])
    with pytest.raises(UserError, match="needs 3 cores"):
        assign_cpus(3, 1, [0, 1])
    with pytest.raises(UserError, match=">= 1"):
        assign_cpus(2, 0, [0, 1])
    assert assign_cpus(len(AVAILABLE), 1) == [[c] for c in AVAILABLE]  # default: this process's cores


def test_the_launcher_refuses_more_cores_than_it_has_in_one_line(capsys):
    n = len(AVAILABLE) + 1
    rc = launch_main(
        ["--processes", str(n), "--cpus-per-process", "1", "--platform", "cpu", "decode", "--target", "x"]
    )
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1 and err.startswith("error: --cpus-per-process 1"), err
    assert "[launch]" not in err  # nothing was started


def test_ssd_jax_cpus_pins_every_thread_and_sizes_xlas_pool():
    """One process, as the hardware-fair AR / SD runs use it: every thread on the one core, and
    XLA's intra-op pool (threads named "tf_XLAEigen") one thread, not one per core of the machine."""
    core = AVAILABLE[-1]
    code = (
        "import os, json, ssd_jax, jax, jax.numpy as jnp\n"
        "jnp.ones((64, 64)).dot(jnp.ones((64, 64))).block_until_ready()\n"
        "tasks = os.listdir('/proc/self/task')\n"
        "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in tasks]\n"
        "print(json.dumps({'pinned': ssd_jax.xla_env.PINNED,"
        " 'threads': sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in tasks}),"
        " 'eigen': sum(n.endswith('XLAEigen') for n in names)}))\n"
    )
    run = lambda extra: subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=launch_env(**extra)
    )
    p = run({CPUS_ENV: str(core)})
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    assert got["pinned"] == [core]
    assert got["threads"] == [[core]]  # every thread, those started before the import included
    # XLA's pool is sized from the pinned cores (its threads may start lazily: at most one here)
    assert got["eigen"] <= 1, got
    free = run({})  # unpinned: one pool thread per core this process may use
    assert free.returncode == 0, free.stderr[-2000:]
    assert json.loads(free.stdout)["eigen"] <= len(AVAILABLE)
    bad = run({CPUS_ENV: "100000"})
    assert bad.returncode != 0 and f"{CPUS_ENV}=100000" in bad.stderr


@pytest.fixture(scope="module")
def ar_run(tiny_llama_path):
    from ssd_jax import SamplingParams, generate, load_model

    return generate(load_model(tiny_llama_path), IDS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))


def test_a_run_records_its_cores(ar_run):
    assert ar_run.metrics["cpus"] == AVAILABLE
    assert "process_cpus" not in ar_run.metrics  # one process


@needs_two_cores
def test_ssd_with_each_process_on_its_own_core_emits_ar_tokens(
    tiny_llama_path, tiny_llama_draft_path, ar_run
):
    cmd = launch_cmd(
        *ssd_decode_args(tiny_llama_path, tiny_llama_draft_path, IDS, N_NEW, "auto"), cpus_per_process=1
    )
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=launch_env())
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert tokens(res) == tokens(ar_run)
    a, b = AVAILABLE[:2]
    m = res["metrics"]
    assert m["cpus"] == [a]  # process 0's own
    assert m["process_cpus"] == [[a], [b]]
    dev = m["devices"]
    assert (dev["target_processes"], dev["draft_processes"]) == ([0], [1])
    assert (dev["target_cpus"], dev["draft_cpus"]) == ([a], [b])
    assert re.search(rf"^\[launch\] process 1 pid \d+ cpus {b}$", p.stderr, re.M), p.stderr[-2000:]
    # K auto also prices the layout against AR on both cores (timed once in a child of process 0)
    ref = m["plan"]["predicted"]["ar_reference"]
    assert ref["cores"] == 2 and ref["t_ar"] > 0 and ref["source"] in ("measured", "cache")
    assert (
        isinstance(ref["pays"], bool)
        and f"vs AR on all 2 cores (t_ar {1e3 * ref['t_ar']:.2f} ms" in ref["line"]
    )
    assert ref["line"] in m["plan"]["line"]


def test_launched_processes_name_every_core_given_out_and_a_reference_child_runs_alone(monkeypatch):
    from ssd_jax.cli.launch import process_env
    from ssd_jax.planning import reference

    base = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=4"}
    env = process_env(0, 2, 1, 1234, "cpu", base, [0], [0, 1])
    assert (env[CPUS_ENV], env[reference.MACHINE_CPUS_ENV]) == ("0", "0,1")
    assert reference.MACHINE_CPUS_ENV not in process_env(0, 2, 1, 1234, "cpu", base)  # not pinned: none
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert reference.machine_cores() == [0, 1]
    child = reference.child_env([0, 1])
    assert child[CPUS_ENV] == "0,1" and child["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"  # one device, same ISA
    assert child["SSD_JAX_KAUTO_RECALIBRATE"] == "1"  # its own timing, whatever target-costs record exists
    assert not {"JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID", reference.MACHINE_CPUS_ENV} & set(child)
    assert not reference.needed()  # this test process is not pinned by the launcher


def test_the_layout_check_prices_the_launched_run_against_ar_on_every_core(monkeypatch):
    """SSD at 1.27x AR on its one core (29.7 ms a step) is 0.87x AR on both (20.4 ms): the demo's case on
    the AVX2 build. A plan that runs AR rounds makes its own core's AR; a plan at 2x pays on both."""
    from ssd_jax.planning import reference

    monkeypatch.setattr(
        reference, "agreed_step", lambda m, b: {"t_ar": 0.0204, "cores": 2, "source": "cache"}
    )
    r = reference.layout_check(None, 1, 0.0297, {"expected_speedup": 1.27})
    assert r["expected_speedup"] == pytest.approx(0.872, abs=1e-3) and r["pays"] is False
    assert "predicted 0.87x: not above it by the planner's 12%" in r["line"]
    r = reference.layout_check(None, 1, 0.0297, {"expected_speedup": 1.05})  # AR rounds on its own core
    assert r["expected_speedup"] == pytest.approx(0.0204 / 0.0297, abs=1e-3) and not r["pays"]
    r = reference.layout_check(None, 1, 0.0297, {"expected_speedup": 2.0})
    assert r["pays"] is True and r["line"].endswith("predicted 1.37x")
