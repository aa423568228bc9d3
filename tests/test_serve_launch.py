"""The server under the launcher (``python -m ssd_jax.launch --processes 2 serve --method ssd ...``):
process 0 serves HTTP and schedules, process 1 runs SSD's draft and steps the same engine as process 0
tells it (``ssd_jax.serve.lockstep``). On the tiny random pair with SmolLM2's tokenizer (cut to 2,048 tokens): greedy
requests over HTTP (concurrent, streamed and not, more than the slots) equal offline AR, a shared
prompt is found in both models' prefix caches, no process listens on a wildcard address, SIGTERM ends
both processes with status 0; a killed process 1 fails the running requests with a server error and ends
the server with a non-zero status."""

import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from helpers import launch_env
from serve_helpers import free_port
from test_serve import PROMPTS, _tiny_dir, small_tokenizer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.realmodel  # SmolLM2's tokenizer comes from the registry


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tok = small_tokenizer()
    root = tmp_path_factory.mktemp("tiny-launch")
    return _tiny_dir(root / "target", tok, 2, 0), _tiny_dir(root / "draft", tok, 1, 1)


def _launch(pair, *flags):
    """(launcher process, base url, its stderr file) once /health answers (K = 2 unless ``flags`` say)."""
    port = free_port()
    k = [] if "--k" in flags else ["--k", "2"]
    cmd = [
        sys.executable, "-m", "ssd_jax.launch", "--processes", "2", "--platform", "cpu", "serve",
        "--target", pair[0], "--method", "ssd", "--draft", pair[1], *k, "--target-devices", "1",
        "--draft-devices", "1", "--max-batch", "4", "--max-model-len", "160", "--port", str(port), *flags,
    ]  # fmt: skip
    err = tempfile.NamedTemporaryFile("w+", suffix=".err")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=launch_env(JAX_PLATFORMS="cpu"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited {proc.returncode}: {open(err.name).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, err
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the launched server did not start")


def _pids(err) -> dict[int, int]:
    text = open(err.name).read()
    return {int(i): int(p) for i, p in re.findall(r"\[launch\] process (\d) pid (\d+)", text)}


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by the launcher) counts as gone
        return "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
    except OSError:
        return False


def _listening(pid: int) -> list[tuple[str, int]]:
    """The (hex address, port) of every TCP socket ``pid`` listens on, from /proc/net/tcp{,6}."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN
                    addr, port = cols[1].split(":")
                    found.append((addr, int(port, 16)))
    return found


def _complete(url, prompt, max_tokens, stream=False):
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    body["model"] = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    if not stream:
        return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    text = ""  # a stream's chunks carry text: its tokens are those of the whole text
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def test_greedy_over_http_equals_offline_ar_then_a_killed_draft_process_ends_the_server(pair):
    """SSD at K = 2 over HTTP: concurrent greedy requests equal offline AR, a shared prompt is found in both
    caches, no process listens on a wildcard address; then process 1 (the draft) is killed mid-generation:
    the running requests fail with a server error and the server exits non-zero. (One server for both:
    SIGTERM's clean exit is checked on the K-auto server below.)"""
    from ssd_jax import SamplingParams, generate, load_model

    lengths = [12, 30, 7, 25, 16, 9, 40, 14]
    model = load_model(pair[0])
    res = generate(model, PROMPTS, SamplingParams(max_new_tokens=max(lengths)))
    want = [o["token_ids"][:n] for o, n in zip(res.outputs, lengths)]
    want = [model.tokenizer.decode(w) if i % 2 else w for i, w in enumerate(want)]  # streamed: text
    proc, url, err = _launch(pair)
    pids = _pids(err)
    got: dict[int, list[int]] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: got.__setitem__(i, _complete(url, PROMPTS[i], lengths[i], i % 2 == 1))
        )
        for i in range(len(PROMPTS))
    ]  # 8 requests on 4 slots, half of them streamed
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [got.get(i) for i in range(len(PROMPTS))] == want
    # no process listens on every interface (the coordinator, the link, gloo and HTTP on loopback)
    listening = {i: _listening(p) for i, p in pids.items()}
    assert listening[0] and not [a for ls in listening.values() for a in ls if set(a[0]) == {"0"}], listening
    # a shared prompt's blocks are found again (both caches: one block table)
    shared = " ".join(PROMPTS)
    first, again = _complete(url, shared + " one", 6), _complete(url, shared + " two", 6)
    text = httpx.get(url + "/metrics").text
    hits = float(re.search(r"^ssd_jax:prefix_cache_hits_total (\S+)", text, re.M).group(1))
    assert hits >= 32, text[-2000:]
    ref = generate(load_model(pair[0]), [shared + " one", shared + " two"], SamplingParams(max_new_tokens=6))
    assert [first, again] == [o["token_ids"] for o in ref.outputs]
    _kill_draft_mid_generation(proc, url, err, pids)


def _kill_draft_mid_generation(proc, url, err, pids):
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    outcomes: list = []
    streaming = threading.Event()

    def one(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": 140, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                last = None
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        last = json.loads(line[6:])
                        streaming.set()
                outcomes.append(("error" in (last or {}), (last or {}).get("error")))
        except httpx.HTTPError as e:  # the server went away mid-stream: also a failed request
            outcomes.append((True, str(e)))

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS[:6]]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    import os

    os.kill(pids[1], signal.SIGKILL)  # process 1 (SSD's draft) dies mid-generation
    for t in threads:
        t.join(90)
    rc = proc.wait(90)
    log = open(err.name).read()
    assert len(outcomes) == 6 and all(not t.is_alive() for t in threads)
    assert any(failed for failed, _ in outcomes), outcomes  # running requests end with a server error
    assert rc != 0 and "Traceback" not in log, log[-3000:]
    assert re.search(r"\[p0\] error: process 0: .*(engine failed|lost|stopped)", log), log[-3000:]
    assert not _alive(pids[0])


def test_k_auto_under_the_launcher_serves_ar_rounds_and_sigterm_ends_both(pair):
    """K auto under the launcher: process 0's timed choice per bucket, agreed by process 1. On the tiny
    random pair (acceptance about 0) every bucket runs AR rounds, the draft left out; concurrent greedy
    requests still equal offline AR; SIGTERM ends both processes with 0."""
    from ssd_jax import SamplingParams, generate, load_model

    res = generate(load_model(pair[0]), PROMPTS[:3], SamplingParams(max_new_tokens=10))
    proc, url, err = _launch(pair, "--k", "auto", "--context-buckets", "1")  # one window: half the programs
    pids = _pids(err)
    got: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, _complete(url, PROMPTS[i], 10)))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(3)] == [o["token_ids"] for o in res.outputs]
    text = httpx.get(url + "/metrics").text
    assert re.search(r'spec_decode_num_rounds_total\{batch="\d",k="0"\} [1-9]', text), text[-1500:]
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(90)
    log = open(err.name).read()
    assert rc == 0 and "by running rows 1: K=0 (AR" in log and "Traceback" not in log, log[-3000:]
    assert "processes=2 (draft on process 1)" in log
    assert not any(_alive(p) for p in pids.values())
