"""``python -m ssd_jax.roundcost``: the round-cost benchmark (:mod:`ssd_jax.bench.roundcost`), one child
process per layout (two JAX processes through ``python -m ssd_jax.launch`` for ``procs``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from ssd_jax.bench.roundcost import LAYOUTS, METHODS, Case, measure_layout, measure_moves, report


def _child_cmd(args, layout: str) -> tuple[list[str], dict]:
    own = [
        "--child", "--layout", layout, "--model", args.model, "--tokens", str(args.tokens), "--k", str(args.k),
        "--repeats", str(args.repeats), "--methods", *args.methods, "--out", args.out,
    ]  # fmt: skip
    if args.draft:
        own += ["--draft", args.draft]
    env = dict(os.environ)
    if layout == "procs":
        launch = [sys.executable, "-m", "ssd_jax.launch", "--processes", "2", "--cpus-per-process", "1"]
        return [*launch, "roundcost", *own], env
    if layout == "meshes":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    return [sys.executable, "-m", "ssd_jax.roundcost", *own], env


def _child(args) -> int:
    """One layout's measurements, appended to ``<out>.jsonl`` by process 0."""
    from ssd_jax.parallel import distributed as dist

    case = Case(args.model, args.draft, args.tokens, args.k, args.repeats)
    rows = measure_layout(case, args.layout, tuple(args.methods))
    moves = measure_moves() if args.layout == "procs" else None
    if dist.is_main():
        with open(f"{args.out}.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        if moves is not None:
            with open(f"{args.out}.moves.json", "w") as f:
                json.dump(moves, f)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ssd_jax.roundcost", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, or a registry target name")
    p.add_argument(
        "--draft", default=None, help="the draft model for a real target (default: its default draft model)"
    )
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--out", required=True, help="results path without extension (.jsonl and .md are written)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="one", help=argparse.SUPPRESS)
    p.add_argument("--distributed", action="store_true", help=argparse.SUPPRESS)
    return p


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.model != "tiny" and args.draft is None:
        from ssd_jax.drafters import default_draft

        args.draft = default_draft(args.model, "model")  # a draft model: SSD has no head across processes
    if args.child:
        if args.distributed:
            from ssd_jax.cli.decode import run_distributed

            return run_distributed(_child, args)
        return _child(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for old in (f"{args.out}.jsonl", f"{args.out}.moves.json"):
        if os.path.exists(old):
            os.remove(old)
    t0 = time.perf_counter()
    for layout in args.layouts:
        cmd, env = _child_cmd(args, layout)
        if subprocess.run(cmd, env=env).returncode:
            from ssd_jax.errors import UserError

            raise UserError(f"the {layout} layout's run failed (its output is above)")
    with open(f"{args.out}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    title = f"{args.model}, K = {args.k}, {args.tokens} tokens, greedy, batch 1 ({time.perf_counter() - t0:.0f} s)"
    text = report(rows, title)
    if os.path.exists(f"{args.out}.moves.json"):
        with open(f"{args.out}.moves.json") as f:
            mv = json.load(f)
        text += (
            f"\nAcross the two processes, a round's integer tensor (1 x 8 int32) there and back (medians of "
            f"{mv['n']}): {mv['collective_ms']:.3f} ms by the compiled collective, {mv['bridge_ms']:.3f} ms by "
            f"the engine's bridge (linked: {mv['bridge_linked']}), {mv['socket_ms']:.3f} ms over a plain TCP "
            "socket.\n"
        )
    with open(f"{args.out}.md", "w") as f:
        f.write(text)
    print(text)
    return 0


def main(argv=None) -> int:
    from ssd_jax.errors import cli_main

    return cli_main(run, argv)
