"""The hardware-fair protocol (``python -m ssd_jax.launch ... bench --suite protocol``): two processes
as the launcher starts them, SSD's target on process 0 and its draft on process 1, AR and SD on
process 0 alone; one results file, SSD's greedy tokens equal AR's (tiny tokenizer-free models,
token-id prompts)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from ssd_jax.bench import protocol
from ssd_jax.cli.launch import process_env

# the child: the protocol's prompts replaced by token ids (the tiny checkpoints have no tokenizer)
CHILD = """
import sys
from ssd_jax.bench import protocol
protocol.category_prompts = lambda c, n: [
    {"id": f"{c}{i}", "prompt": [3 + i, 9, 11, 3 + i, 9]} for i in range(n)]
from ssd_jax.cli.bench import main
sys.exit(main(sys.argv[1:]))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # default-suite budget: two-process SSD's exactness runs in test_launch_pinning
def test_fair_protocol_two_processes(tmp_path, tiny_llama_path, tiny_llama_draft_path):
    args = [
        "--suite",
        "protocol",
        "--distributed",
        "--target",
        tiny_llama_path,
        "--draft",
        tiny_llama_draft_path,
        "--methods",
        "ar",
        "sd:2",
        "ssd:2",
        "--categories",
        "code",
        "--n-prompts",
        "2",
        "--repeats",
        "1",
        "--new-tokens",
        "6",
        "--bandwidth",
        "10",
        "--out",
        str(tmp_path),
        "--tag",
        "fair",
    ]
    port, base = _port(), {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, *args],
            env=process_env(i, 2, 1, port, "cpu", base, secret="fair-protocol-test"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    files = list(tmp_path.glob("protocol_*_fair.jsonl"))
    assert len(files) == 1  # process 0 alone writes
    rows = protocol.read_rows(files[0])
    env = [r for r in rows if r["kind"] == "env"]
    assert len(env) == 1 and env[0]["hardware_fair"]["two_process_methods"] == ["ssd-k2"]
    runs = [r for r in rows if r["kind"] == "run"]
    assert sorted({r["method"] for r in runs}) == ["ar", "sd-k2", "ssd-k2"] and len(runs) == 3 * 2
    by = {(r["method"], r["prompt_index"]): r["tokens_sha"] for r in runs}
    for i in range(2):  # greedy: SD and SSD (draft in the other process) emit AR's tokens
        assert by[("sd-k2", i)] == by[("ar", i)] == by[("ssd-k2", i)]
    assert all(r["generated_tokens"] == 6 for r in runs)
    # after the warm-up nothing compiles, the cross-process moves included
    assert [r["method"] for r in runs if (r.get("compile_s") or 0) > 0] == []
    assert json.dumps(env[0]["hardware_fair"])  # the layout is recorded
    assert (tmp_path / files[0].with_suffix(".md").name).exists()
