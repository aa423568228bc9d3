"""``python -m ssd_jax.launch``: run a command as several JAX processes on this machine.

    python -m ssd_jax.launch --processes 2 --devices-per-process 2 decode ARGS...

starts ``python -m ssd_jax.decode --distributed ARGS...`` ``--processes`` times, each with
``JAX_COORDINATOR_ADDRESS`` (a free port on 127.0.0.1, where the coordination service and the processes'
link then listen), ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` and ``SSD_JAX_LINK_SECRET`` (made for this
run: the link takes only a peer that holds it, :mod:`ssd_jax.parallel.link`) set, and its own devices: ``--devices-per-process`` fake CPU devices on CPU
(``--xla_force_host_platform_device_count``), or that many GPUs (``CUDA_VISIBLE_DEVICES``) on a
GPU machine. ``jax.devices()`` then lists every process's devices in process order, so
``--target-devices M --draft-devices N`` with M = N = devices-per-process puts the target on
process 0 and the draft on process 1.

``--cpus-per-process N`` gives process i the cores [i*N, (i+1)*N) of those the launcher may use
(``os.sched_getaffinity``, sorted), through ``SSD_JAX_CPUS``, which ``import ssd_jax`` applies
before JAX starts (:mod:`ssd_jax.xla_env`; XLA sizes its thread pool from it). SSD's draft then
computes on hardware of its own, as the target's verify does (on a GPU machine each process gets
its own GPUs already). Without it every process may use every core. Every process also gets
``SSD_JAX_MACHINE_CPUS``, all the cores given out: SSD's plan is priced against AR on all of them
(:mod:`ssd_jax.planning.reference`).

Process 0's stdout is forwarded as it is (so ``--json`` output parses); every process's stderr
(and the other processes' stdout) goes to stderr, each line prefixed ``[pN]``. When a process
exits with a non-zero status the launcher stops the others and exits with that status (128 +
signal for a killed process), after one line saying which process failed. SIGTERM is passed on to
every process and the launcher exits with their status (0 for a server that shut down cleanly:
``serve`` runs HTTP in process 0 and SSD's draft in process 1, :mod:`ssd_jax.serve.lockstep`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from ssd_jax.cli.args import Parser

COMMANDS = {
    "decode": "ssd_jax.decode",
    "bench": "ssd_jax.bench",
    "roundcost": "ssd_jax.roundcost",
    "serve": "ssd_jax.serve",
}
#: seconds between SIGTERM and SIGKILL when stopping the remaining processes
GRACE_S = 3.0


def build_parser() -> Parser:
    p = Parser(prog="python -m ssd_jax.launch", description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2, help="number of JAX processes (default 2)")
    p.add_argument("--devices-per-process", type=int, default=1, help="devices each process owns (default 1)")
    p.add_argument(
        "--platform",
        default="auto",
        choices=("auto", "cpu", "gpu"),
        help="cpu: fake CPU devices; gpu: split the GPUs; auto: gpu when nvidia-smi lists any",
    )
    p.add_argument(
        "--cpus-per-process",
        type=int,
        default=None,
        metavar="N",
        help="pin process i to cores [i*N, (i+1)*N) of those this launcher may use "
        "(default: no pinning, every process may use every core)",
    )
    p.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument(
        "--no-kill",
        action="store_true",
        help="when a process fails, leave the others to notice "
        "it themselves (tests the runtime's own failure handling) instead of stopping them",
    )
    p.add_argument("command", choices=sorted(COMMANDS), help="the ssd_jax command to run")
    p.add_argument("args", nargs="...", help="its arguments (--distributed is added)")
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def assign_cpus(processes: int, per: int, available=None) -> list[list[int]]:
    """Disjoint core sets: process i gets cores [i*per, (i+1)*per) of ``available`` (default: the
    cores this process may use), sorted. A UserError when there are not enough."""
    from ssd_jax.errors import UserError
    from ssd_jax.xla_env import cpus

    cores = sorted(available) if available is not None else cpus()
    if per < 1:
        raise UserError("--cpus-per-process must be >= 1")
    if processes * per > len(cores):
        raise UserError(
            f"--cpus-per-process {per} x {processes} processes needs {processes * per} cores; "
            f"this launcher may use {len(cores)} ({','.join(map(str, cores))})"
        )
    return [cores[i * per : (i + 1) * per] for i in range(processes)]


def process_env(
    i: int,
    n: int,
    per: int,
    port: int,
    platform: str,
    base: dict,
    cpus: list[int] | None = None,
    machine: list[int] | None = None,
    secret: str | None = None,
) -> dict:
    env = dict(base)
    if secret is not None:  # the link's per-run secret (ssd_jax.parallel.link): only this run's processes
        from ssd_jax.parallel.link import SECRET_ENV, SECRET_FILE_ENV

        env.pop(SECRET_FILE_ENV, None)
        env[SECRET_ENV] = secret
    if cpus is not None:  # applied by ssd_jax.xla_env on import, before JAX starts
        from ssd_jax.xla_env import CPUS_ENV

        env[CPUS_ENV] = ",".join(map(str, cpus))
    if machine is not None:  # every launched process's cores: what AR would run on (planning/reference.py)
        env["SSD_JAX_MACHINE_CPUS"] = ",".join(map(str, sorted(machine)))
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(n),
        JAX_PROCESS_ID=str(i),
        PYTHONUNBUFFERED="1",
    )
    if platform == "cpu":
        flags = [
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={per}"])
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * per + j) for j in range(per))
    return env


def _forward(stream, out, prefix: bytes) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line if prefix else line)
        out.flush()
    stream.close()


def _status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _envs(args, platform: str, pins: list) -> list[dict]:
    """Every process's environment: one coordinator port on 127.0.0.1 and one fresh link secret for
    the run (in the processes' environment only), each process's devices and cores."""
    import secrets

    machine = sorted({c for pin in pins for c in pin}) if args.cpus_per_process is not None else None
    port, secret = args.port or free_port(), secrets.token_hex(32)
    n, per = args.processes, args.devices_per_process
    return [process_env(i, n, per, port, platform, os.environ, pins[i], machine, secret) for i in range(n)]


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.processes < 1 or args.devices_per_process < 1:
        from ssd_jax.errors import UserError

        raise UserError("--processes and --devices-per-process must be >= 1")
    platform = args.platform
    if platform == "auto":
        platform = "gpu" if _gpu_count() else "cpu"
    if platform == "gpu" and _gpu_count() < args.processes * args.devices_per_process:
        from ssd_jax.errors import UserError

        raise UserError(
            f"{args.processes} x {args.devices_per_process} GPUs asked for, {_gpu_count()} present"
        )
    pins = (
        assign_cpus(args.processes, args.cpus_per_process)
        if args.cpus_per_process is not None
        else [None] * args.processes
    )
    envs = _envs(args, platform, pins)
    cmd = [sys.executable, "-m", COMMANDS[args.command], "--distributed", *args.args]
    out_b, err_b = sys.stdout.buffer, sys.stderr.buffer
    procs, threads = [], []
    for i in range(args.processes):
        p = subprocess.Popen(
            cmd,
            env=envs[i],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        procs.append(p)
        prefix = f"[p{i}] ".encode()
        threads += [
            threading.Thread(
                target=_forward,
                args=(p.stdout, out_b if i == 0 else err_b, b"" if i == 0 else prefix),
                daemon=True,
            ),
            threading.Thread(target=_forward, args=(p.stderr, err_b, prefix), daemon=True),
        ]
        on = f" cpus {','.join(map(str, pins[i]))}" if pins[i] is not None else ""
        err_b.write(f"[launch] process {i} pid {p.pid}{on}\n".encode())
    err_b.flush()
    for t in threads:
        t.start()

    def stop_all(*_):
        for p in procs:
            if p.poll() is None:
                p.terminate()

    # SIGTERM is passed on and the launcher waits: a server drains its requests and every process exits 0
    signal.signal(signal.SIGTERM, lambda *a: stop_all())
    try:
        first_bad = _watch(procs, stop_all, args.no_kill, err_b)
    except KeyboardInterrupt:
        stop_all()
        for p in procs:
            p.wait()
        return 130
    for t in threads:
        t.join(timeout=5)
    if first_bad is None:
        first_bad = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
        if first_bad is not None:
            err_b.write(f"[launch] process {first_bad[0]} {_describe(first_bad[1])}\n".encode())
    return 0 if first_bad is None else _status(first_bad[1])


def _watch(procs, stop_all, no_kill: bool, err_b):
    """Poll the processes until all have ended; on the first failure stop the others (kill them after
    ``GRACE_S``) unless ``no_kill``. Returns (index, status) of the first that failed, or None."""
    first_bad = None
    while [p.poll() for p in procs].count(None):  # poll every process (any() would stop at the first)
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if bad and first_bad is None:
            first_bad = bad[0]
            i, rc = first_bad
            err_b.write(
                f"[launch] process {i} {_describe(rc)}; {'waiting for' if no_kill else 'stopping'} the others\n".encode()
            )
            err_b.flush()
            if not no_kill:
                stop_all()
                deadline = time.monotonic() + GRACE_S
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    time.sleep(0.05)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
        time.sleep(0.05)
    return first_bad


def main(argv=None) -> int:
    from ssd_jax.errors import cli_main

    return cli_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
