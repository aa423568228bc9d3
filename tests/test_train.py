"""Draft training (ssd_jax.training) and trained-draft loading (ssd_jax.loading.draft), on tiny models.

Every run here uses the same tiny target and the same hyper-parameters, so the jitted train
and eval steps compile once for the whole module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import numpy as np
import pytest
from test_loading import tiny_tokenizer

from ssd_jax import training as T
from ssd_jax.cli import train as train_cli
from ssd_jax.errors import UserError
from ssd_jax.loading import draft as dfmt
from ssd_jax.loading import load_model, store
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import flatten, init_params
from ssd_jax.training import loop as train_loop

TARGET_CFG = ModelConfig(
    vocab_size=272,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    eos_token_ids=(2,),
    tie_embeddings=True,
)
STEPS = 8


class Killed(Exception):
    """Stands in for a kill: raised from inside the training loop."""


def save_tiny_target(root, sha_byte: str) -> None:
    """The tiny random target (``TARGET_CFG``) saved as a converted model at ``root/target``."""
    os.environ["SSD_JAX_NO_PROGRESS"] = "1"
    flat = {k: np.asarray(v) for k, v in flatten(init_params(TARGET_CFG, 0, scale=0.15)).items()}
    store.save_converted(
        root / "target",
        TARGET_CFG,
        iter(flat.items()),
        tiny_tokenizer(),
        {"source_sha256": sha_byte * 32, "name": "tiny-target"},
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    save_tiny_target(root, "ab")
    words = "the quick brown fox jumps over the lazy dog and hello world again".split()
    rng = np.random.default_rng(0)
    docs = [
        " ".join(words[j % len(words)] for j in range(i, i + 12 + i % 7)) + f" {rng.integers(100)}"
        for i in range(300)
    ]
    (root / "data.txt").write_text("\n\n".join(docs))
    return root


def targs(env, out, **kw) -> T.TrainArgs:
    base = dict(
        target=str(env / "target"),
        size="40K",
        steps=STEPS,
        batch_size=4,
        seq_len=32,
        lr=3e-3,
        warmup=2,
        eval_every=4,
        eval_windows=4,
        data=str(env / "data.txt"),
        out=str(env / out),
    )
    return T.TrainArgs(**{**base, **kw})


def read_log(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


def restore_state(out: Path, step: int):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ck:
        return {k: ck.restore((out / "state" / str(step) / k).absolute()) for k in ("params", "opt_state")}


@pytest.fixture(scope="module")
def run_a(env):
    """An uninterrupted run."""
    return T.train(targs(env, "a"))


@pytest.fixture(scope="module")
def run_b(env, run_a):
    """The same run killed at step 6 (last save at 4) with a half-written save left behind, then resumed."""

    def kill(step, rec):
        if step == 6:
            raise Killed

    with pytest.raises(Killed):
        T.train(targs(env, "b"), on_step=kill)
    out = env / "b"
    assert dfmt.complete_steps(out / "state") == [4]
    # what a kill -9 in the middle of orbax writing step 6 leaves: a temporary directory
    junk = out / "state" / "6.orbax-checkpoint-tmp-1234567"
    (junk / "params").mkdir(parents=True)
    (junk / "params" / "manifest.ocdbt").write_bytes(b"\x00" * 10)
    assert load_model(out).source.endswith("best/params")  # the last complete state stays loadable
    return T.train(targs(env, "b", resume=True))


def test_train_step_lowers_the_loss(run_a, env):
    evals = {e["step"]: e for e in run_a["meta"]["evals"]}
    assert sorted(evals) == [0, 4, 8]
    assert evals[8]["kl"] < 0.9 * evals[0]["kl"]  # held-out: the draft generalises
    assert evals[8]["alpha"] > evals[0]["alpha"]
    log = read_log(env / "a")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert np.mean([r["loss"] for r in log[-2:]]) < np.mean([r["loss"] for r in log[:2]])
    for e in evals.values():  # α and greedy match are probabilities; ppl > 1
        assert 0 <= e["greedy_match"] <= 1 and 0 < e["alpha"] <= 1 and e["ppl"] > 1


def test_resume_after_kill_is_bit_identical(run_a, run_b, env):
    a, b = restore_state(env / "a", STEPS), restore_state(env / "b", STEPS)
    chex.assert_trees_all_equal(a["params"], b["params"])
    chex.assert_trees_all_equal(a["opt_state"], b["opt_state"])
    assert read_log(env / "a") == read_log(env / "b")  # the same loss curve, step by step
    ea, eb = run_a["meta"]["evals"], run_b["meta"]["evals"]
    assert [{k: v for k, v in e.items() if k != "eval_s"} for e in ea] == [
        {k: v for k, v in e.items() if k != "eval_s"} for e in eb
    ]
    assert not list((env / "b" / "state").glob("*tmp*"))  # orbax cleaned the half-written save


def test_metadata(run_a, env):
    meta = dfmt.read_meta(env / "a")
    assert meta["step"] == STEPS and meta["target"]["weights_sha256"] == "ab" * 32
    assert meta["shared"]["tensors"] == ["embed"]
    law = meta["params"]["law"]
    assert (
        law["sizing"] == "explicit"
        and law["n_opt"] > 0
        and law["M"] == TARGET_CFG.num_layers * T.layer_param_count(TARGET_CFG) + 272 * 64 + 64
    )
    assert meta["params"]["N"] == meta["params"]["trained"]
    assert meta["train"]["data_seed"] == 0 and meta["train"]["data"]["train"]["tokens"] > 0
    best = dfmt.read_meta(env / "a" / "best")
    assert best["best"]["alpha"] == max(e["alpha"] for e in meta["evals"])
    assert best["step"] == best["best"]["step"]


def test_sdsl_counts_a_trained_draft(run_a, env):
    from ssd_jax.cli import sdsl

    meta = dfmt.read_meta(env / "a")
    got = sdsl.model_params(str(env / "a"))
    assert got["non_embedding"] == meta["params"]["trained"]


def test_checkpoint_loads_as_a_draft(run_a, env):
    from ssd_jax import SamplingParams, SpecConfig, generate

    target = load_model(env / "target")
    draft = load_model(env / "a")
    meta = dfmt.read_meta(env / "a" / "best")
    assert draft.cfg.num_layers == meta["config"]["num_layers"] and draft.cfg.tie_embeddings
    assert draft.tokenizer.fingerprint() == target.tokenizer.fingerprint()
    np.testing.assert_array_equal(np.asarray(draft.params["embed"]), np.asarray(target.params["embed"]))
    step = meta["step"]
    saved = restore_state(env / "a", step)["params"] if step else None
    if saved is not None:
        np.testing.assert_array_equal(np.asarray(draft.params["final_norm"]), np.asarray(saved["final_norm"]))
    prompts = [[3, 70, 80, 90, 4], [5, 6, 7]]
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
    ar = generate(target, prompts, sp)
    sd = generate(target, prompts, sp, SpecConfig(method="sd", draft=str(env / "a"), k=2))
    assert [o["token_ids"] for o in sd.outputs] == [o["token_ids"] for o in ar.outputs]


def test_bad_checkpoints_are_one_line_errors(run_a, env, tmp_path):
    with pytest.raises(UserError, match="unknown model"):
        load_model(tmp_path / "missing")
    bad = tmp_path / "bad"
    shutil.copytree(env / "a" / "best", bad)
    (bad / "draft.json").write_text("{not json")
    with pytest.raises(UserError, match="unusable"):
        load_model(bad)
    shutil.rmtree(bad)
    shutil.copytree(env / "a" / "best", bad)
    for f in (bad / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    with pytest.raises(UserError, match="unusable") as e:
        load_model(bad)
    assert "\n" not in str(e.value)
    shutil.rmtree(bad)
    shutil.copytree(env / "a" / "best", bad)
    meta = json.loads((bad / "draft.json").read_text())
    meta["target"]["weights_sha256"] = "cd" * 32
    (bad / "draft.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="wrong target"):
        load_model(bad)


def test_bad_arguments(run_a, env, capsys):
    assert train_cli.main(["--target", str(env / "target"), "--size", "0", "--out", str(env / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --size") and "\n" not in err
    with pytest.raises(UserError, match="already holds a training run"):
        T.train(targs(env, "a"))
    with pytest.raises(UserError, match="different --lr"):
        T.train(targs(env, "a", lr=1e-3, resume=True))
    with pytest.raises(UserError, match="--loss"):
        T.train(targs(env, "y", loss="l2"))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(run_a, env, monkeypatch):
    real = T.make_train_step

    def poisoned(*a):
        step = real(*a)

        def f(params, opt_state, batch, frozen):
            params, opt_state, m = step(params, opt_state, batch, frozen)
            f.calls += 1
            return params, opt_state, ({**m, "loss": m["loss"] * np.nan} if f.calls == 6 else m)

        f.calls = 0
        return f

    monkeypatch.setattr(train_loop, "make_train_step", poisoned)
    with pytest.raises(UserError, match=r"loss became nan at step 6.*last good checkpoint is step 4"):
        T.train(targs(env, "nan"))
    assert dfmt.complete_steps(env / "nan" / "state") == [4]


def test_sizing():
    smol = ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        tie_embeddings=True,
    )
    cfg, law = T.size_draft(smol, "auto")
    assert 9e6 < law["n_opt"] < 13e6  # SDSL for M = 134.5M
    assert cfg.num_layers == 3 and cfg.hidden_size == 576 and cfg.tie_embeddings
    assert T.param_report(cfg, smol)["trained"] * 4 < 50e6  # stored float32 draft under 50 MB
    assert T.size_draft(smol, "20M")[0].num_layers == 6
    with pytest.warns(UserWarning, match="as deep as"):
        T.size_draft(smol, "200M")
    for bad in ("0", "-3", "abc", "nan"):
        with pytest.raises(UserError, match="--size"):
            T.parse_size(bad)
    assert T.init_layer_indices("spread", 30, 3) == [0, 14, 29]
    assert T.init_layer_indices("first", 30, 3) == [0, 1, 2]
    with pytest.raises(UserError, match="init-layers"):
        T.init_layer_indices("0,40,2", 30, 3)


def test_data_order_is_a_function_of_seed_and_step():
    stream = np.arange(1000, dtype=np.int32)
    a = T.train_batch(stream, 7, 3, 4, 10)
    np.testing.assert_array_equal(a, T.train_batch(stream, 7, 3, 4, 10))
    assert not np.array_equal(a, T.train_batch(stream, 7, 4, 4, 10))
    np.testing.assert_array_equal(a[:, 1:], a[:, :-1] + 1)  # contiguous windows
    starts = np.concatenate([T.train_batch(stream, s, 3, 4, 10)[:, 0] for s in range(99 // 4 + 1)])
    assert len(set(starts[:99].tolist())) == 99  # one epoch visits every window once


def _subprocess_env():
    env = dict(os.environ, SSD_JAX_NO_PROGRESS="1", JAX_PLATFORMS="cpu")
    # XLA_FLAGS kept: the subprocess compiles as the in-process ``run_a`` does, so the floats can match
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    return env


@pytest.mark.slow
def test_real_kill_9_then_resume(run_a, env):
    """A real ``kill -9`` of ``python -m ssd_jax.train``, then ``--resume``: same final state."""
    out = env / "k"
    cmd = [
        sys.executable,
        "-m",
        "ssd_jax.train",
        "--target",
        str(env / "target"),
        "--size",
        "40K",
        "--steps",
        str(STEPS),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--lr",
        "3e-3",
        "--warmup",
        "2",
        "--eval-every",
        "4",
        "--eval-windows",
        "4",
        "--save-every",
        "2",
        "--data",
        str(env / "data.txt"),
        "--out",
        str(out),
    ]
    env_ = {
        **_subprocess_env(),
        "JAX_COMPILATION_CACHE_DIR": str(env / "jax-cache"),
    }  # the resume reuses the compile
    p = subprocess.Popen(cmd, env=env_, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        log = out / "train_log.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL
    killed_at = dfmt.complete_steps(out / "state")
    assert not killed_at or killed_at[0] < STEPS, "the run finished before the kill"
    r = subprocess.run(cmd + ["--resume"], env=env_, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"from step {killed_at[0]}" in r.stderr if killed_at else "starting from step 0" in r.stderr
    a, k = restore_state(env / "a", STEPS), restore_state(out, STEPS)
    chex.assert_trees_all_equal(a["params"], k["params"])
    chex.assert_trees_all_equal(a["opt_state"], k["opt_state"])
    assert read_log(env / "a") == read_log(out)
