"""The `python -m ssd_jax.decode` contract: JSON output, and one-line errors with exit status 2."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import xla_flags


def run_cli(*args, env=None):
    e = dict(os.environ, XLA_FLAGS=xla_flags())  # one device, with the test run's XLA flags
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ssd_jax.decode", *args], capture_output=True, text=True, timeout=600, env=e
    )


def assert_one_line_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert needle.lower() in lines[0].lower(), lines[0]
    assert r.stdout == ""


def test_json_contract_on_tiny_model(tiny_llama_path):
    r = run_cli(
        "--target",
        tiny_llama_path,
        "--prompt-ids",
        "1,2,3",
        "--prompt-ids",
        "4,5,6,7,8",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert d["method"] == "ar"
    assert [len(o["token_ids"]) for o in d["outputs"]] == [6, 6]
    assert {"prompt", "text", "token_ids"} <= set(d["outputs"][0])
    for k in ("generated_tokens", "tokens_per_s", "ttft_s", "tpot_s", "wall_s", "compile_s"):
        assert k in d["metrics"]


BAD_FLAGS = [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--top-k", "-3"], "top-k"),
    (["--prompt", "   "], "empty prompt"),
    (["--prompt-ids", "1,x"], "prompt-ids"),
    (["--max-new-tokens", "abc"], "max-new-tokens"),
    (["--method", "beam"], "unknown method"),
    (["--method", "sd", "--draft", "ngram", "--k", "0"], "k must be"),
    (["--method", "sd", "--draft", "ngram", "--k", "abc"], "k must be"),
]
BAD_SSD_FLAGS = [
    (["--method", "ssd", "--draft", "ngram"], "draft model"),
    (["--method", "ssd", "--draft", "x", "--saguaro-c", "2"], "saguaro"),
    (["--method", "ssd", "--draft", "x", "--fan-out", "many"], "fan-out"),
    (["--method", "ssd", "--draft", "x", "--backup", "psychic"], "backup"),
    (["--method", "sd", "--draft", "ngram", "--trace", "t.json"], "trace"),
]


def _error_cases(tiny: str, tmp) -> dict:
    """The error cases that need files: name -> arguments."""
    bad = tmp / "p.jsonl"
    bad.write_text('{"prompt": "hi"}\n{not json\n')
    junk = tmp / "junk.gguf"
    junk.write_bytes(b"GGUF" + os.urandom(256))
    return {
        "invalid-jsonl": ["--target", tiny, "--prompts-file", str(bad)],
        "missing-prompts-file": ["--target", tiny, "--prompts-file", str(tmp / "nope")],
        "unknown-model": ["--target", "no-such-model-xyz", "--prompt", "hi"],
        "missing-gguf": ["--target", str(tmp / "missing.gguf"), "--prompt", "hi"],
        "junk-gguf": ["--target", str(junk), "--prompt", "hi"],
        "beyond-context": ["--target", tiny, "--prompt-ids", "1,2,3", "--max-new-tokens", "100000"],
    }


# One interpreter runs every error case through the entry ``python -m ssd_jax.decode`` runs (the module
# as __main__, its sys.exit), each case with its own stdout, stderr and exit status: one interpreter start
# instead of twenty-one. Whatever bypasses Python's streams (C++ logging) lands in the interpreter's own
# stderr, which must stay empty.
BATCH = """
import contextlib, io, json, runpy, sys, traceback
res = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["ssd_jax.decode", *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("ssd_jax.decode", run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            rc = 1
            traceback.print_exc()
    res.append([rc, out.getvalue(), err.getvalue()])
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def error_runs(tiny_llama_path, tmp_path_factory):
    """(exit status, stdout, stderr) of every error case: by its arguments for BAD_FLAGS and
    BAD_SSD_FLAGS, by name for _error_cases."""
    named = _error_cases(tiny_llama_path, tmp_path_factory.mktemp("cli-errors"))
    keys = [tuple(args) for args, _ in BAD_FLAGS + BAD_SSD_FLAGS] + list(named)
    cases = [list(k) if isinstance(k, tuple) else named[k] for k in keys]
    r = subprocess.run(
        [sys.executable, "-c", BATCH, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, XLA_FLAGS=xla_flags()),
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    return {
        k: SimpleNamespace(returncode=rc, stdout=out, stderr=err)
        for k, (rc, out, err) in zip(keys, json.loads(r.stdout))
    }


def test_prompts_file_jsonl_and_lines(error_runs):
    assert_one_line_error(error_runs["invalid-jsonl"], "invalid JSON")
    assert_one_line_error(error_runs["missing-prompts-file"], "not found")


@pytest.mark.parametrize("args,needle", BAD_FLAGS)
def test_bad_flags(error_runs, args, needle):
    assert_one_line_error(error_runs[tuple(args)], needle)


def test_unknown_model_and_bad_files(error_runs):
    assert_one_line_error(error_runs["unknown-model"], "unknown model")
    assert_one_line_error(error_runs["missing-gguf"], "missing.gguf")
    assert_one_line_error(error_runs["junk-gguf"], "junk.gguf")


def test_prompt_beyond_context_window(error_runs):
    assert_one_line_error(error_runs["beyond-context"], "context window")


@pytest.mark.realmodel
def test_default_run_and_contract_on_smollm():
    r = run_cli("--max-new-tokens", "8", "--json")  # a short budget, otherwise the defaults: model + prompt
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["method"] == "ar"
    assert len(d["outputs"]) == 1 and d["outputs"][0]["text"].strip()


@pytest.mark.realmodel
def test_sd_with_an_unverifiable_tokenizer_is_refused(tiny_llama_path):
    """A tokenizer-less tiny model cannot be shown to share SmolLM2's vocabulary: exit 2, one line."""
    r = run_cli(
        "--target",
        "smollm2-135m-instruct",
        "--draft",
        tiny_llama_path,
        "--method",
        "sd",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "4",
    )
    assert_one_line_error(r, "share a tokenizer")


@pytest.mark.parametrize("args,needle", BAD_SSD_FLAGS)
def test_bad_ssd_flags(error_runs, args, needle):
    assert_one_line_error(error_runs[tuple(args)], needle)


def test_ssd_cli_json_trace_and_meshes(tiny_llama_path, tmp_path):
    trace = tmp_path / "trace.json"
    common = [
        "--target",
        tiny_llama_path,
        "--draft",
        tiny_llama_path,
        "--prompt-ids",
        "1,2,3",
        "--prompt-ids",
        "4,5,6,7,8",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--json",
        "--k",
        "2",
    ]
    env = {"XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4")}
    r = run_cli(
        *common,
        "--method",
        "ssd",
        "--target-devices",
        "2",
        "--draft-devices",
        "2",
        "--trace",
        str(trace),
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["method"] == "ssd"
    for k in (
        "cache_hit_rate",
        "tau_hit",
        "tau_miss",
        "fallback_calls",
        "fanout",
        "acceptance_rate",
        "draft_s",
        "verify_s",
        "sample_s",
        "overhead_s",
    ):
        assert k in d["metrics"]
    assert d["metrics"]["cache_hit_rate"] == 1.0  # the draft is the target itself
    ar = json.loads(run_cli(*common).stdout)
    assert [o["token_ids"] for o in d["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
    assert any(e.get("name") == "build" for e in json.loads(trace.read_text())["traceEvents"])
    r = run_cli(*common, "--method", "ssd", "--target-devices", "3", "--draft-devices", "2", env=env)
    assert_one_line_error(r, "devices")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--n", "0"], "n must be"),
        (["--fan-out", "0"], "fan-out must be"),
        (["--method", "ssd", "--draft", "x", "--fan-out-budget", "0"], "fan-out budget"),
        (["--method", "ssd", "--draft", "x", "--target-devices", "0"], "target-devices"),
        (["--method", "ssd", "--draft", "x", "--draft-devices", "9"], "devices"),
        (
            ["--method", "sd", "--draft", "ngram", "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
            "prompt-lookup-min",
        ),
        (["--temperature", "nan"], "temperature"),
        (["--top-k", "-1"], "top-k"),
        (["--k", "0"], "k must be"),
        (["--k", "abc"], "k must be"),
        (["--k", "2.5"], "k must be"),
        (["--method", "ssd", "--draft", "x", "--saguaro-c", "-1"], "saguaro"),
        (["--saguaro-c", "2"], "saguaro"),
        (["--saguaro-c", "nan"], "saguaro"),
    ],
)
def test_bad_values_in_process(args, needle, capsys):
    """Each bad value: one line on stderr, nothing on stdout, exit status 2, before any model is loaded
    (8 fake devices here, so 9 draft devices do not exist)."""
    from ssd_jax.cli.decode import main

    rc = main([*args, "--target", "no-such-model-would-be-loaded", "--prompt", "hi"])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and out == "" and len(lines) == 1, (rc, out, err)
    assert needle.lower() in lines[0].lower(), lines[0]


def test_bad_prompt_inputs_in_process(tiny_llama_path, tmp_path, capsys):
    from ssd_jax.cli.decode import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    cases = [
        (["--prompts-file", str(tmp_path / "missing.jsonl")], "not found"),
        (["--prompts-file", str(bad)], "no 'prompt' string"),
        (["--prompt-ids", "1,2,128"], "outside the vocabulary"),
        (["--prompt-ids", "-1"], "outside the vocabulary"),
    ]
    for args, needle in cases:
        rc = main(["--target", tiny_llama_path, "--max-new-tokens", "2", *args])
        out, err = capsys.readouterr()
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and out == "" and len(lines) == 1, (args, rc, out, err)
        assert needle.lower() in lines[0].lower(), lines[0]


@pytest.mark.slow  # 20-30 s; seeded SSD reproducibility per backup is in test_exactness
def test_seeded_sampled_ssd_auto_is_reproducible_from_the_cli(tiny_llama_path, tiny_llama_draft_path):
    args = [
        "--target",
        tiny_llama_path,
        "--draft",
        tiny_llama_draft_path,
        "--method",
        "ssd",
        "--backup",
        "auto",
        "--temperature",
        "1",
        "--seed",
        "3",
        "--n",
        "6",
        "--prompt-ids",
        "1,2,3",
        "--prompt-ids",
        "4,5,6,7,8",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--json",
        "--k",
        "3",
    ]
    runs = [run_cli(*args) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = (json.loads(r.stdout) for r in runs)
    assert [o["token_ids"] for o in a["outputs"]] == [o["token_ids"] for o in b["outputs"]]
    assert a["metrics"]["fallback_calls"] == b["metrics"]["fallback_calls"]
    assert 0.0 < a["metrics"]["cache_hit_rate"] < 1.0  # misses happened, so the backup choice mattered
