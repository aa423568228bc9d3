"""Start-up of the SSD server in one process (two devices) against under the launcher (two processes).

    python experiments/probes/serve_launch_startup.py --target smollm2-135m-instruct \
        --draft smollm2-135m-draft --repeats 2 --out FILE.json

Alternates the two layouts, ``--repeats`` starts each, and times each from the command to the first
``/health`` that answers 200 (warm caches: run once before to fill the compile and calibration caches).
Every start uses the same flags (K auto, the planner's cached calibration); each server is stopped with
SIGTERM before the next starts. Writes every start's seconds and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(layout: str, target: str, draft: str) -> float:
    import httpx

    port = _port()
    flags = ["--target", target, "--method", "ssd", "--draft", draft, "--target-devices", "1",
             "--draft-devices", "1", "--port", str(port)]  # fmt: skip
    env = dict(os.environ)
    if layout == "launcher":
        cmd = [sys.executable, "-m", "ssd_jax.launch", "--processes", "2", "--cpus-per-process", "1", "serve"]
    else:
        cmd = [sys.executable, "-m", "ssd_jax.serve"]
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd + flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{layout} server exited {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    runs = []
    for rep in range(a.repeats):
        for layout in ("one process", "launcher") if rep % 2 == 0 else ("launcher", "one process"):
            s = start_once(layout, a.target, a.draft)
            runs.append({"layout": layout, "repeat": rep, "seconds": s, "load": os.getloadavg()[0]})
            print(f"{layout}: {s:.1f} s", file=sys.stderr)
    with open(a.out, "w") as f:
        json.dump({"target": a.target, "draft": a.draft, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
