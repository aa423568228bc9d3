"""Starting ``python -m ssd_jax.serve`` in a subprocess for the server tests, and reading its /metrics."""

import os
import signal
import socket
import subprocess
import sys
import time

from helpers import xla_flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(target: str, *flags, timeout: float = 300, devices: int = 1):
    """(process, base url) of a server on a free port, once /health answers; ``devices``: CPU devices
    the process sees (2: a target device and a draft device)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "ssd_jax.serve", "--target", target, "--port", str(port), *flags]
    # one device, as a user runs it, unless asked for more; the test run's XLA flags (conftest.py)
    count = [f"--xla_force_host_platform_device_count={devices}"] if devices > 1 else []
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(*count)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start")


def stop(proc) -> tuple[int, str]:
    """SIGTERM, then (exit status, stderr)."""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def metrics(url) -> dict[str, float]:
    """Every non-bucket sample of /metrics, parsed by prometheus-client: ``name|label=value...`` -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[key] = s.value
    return out
