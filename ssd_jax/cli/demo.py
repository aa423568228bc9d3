"""``python -m ssd_jax.demo`` (``make demo``): the main job in one table. AR, SD and SSD on the default
pair, one prompt each, greedy: SD with the target's default SD draft in this process's layout, SSD with
its draft model in a JAX process of its own (``python -m ssd_jax.launch --processes 2
--cpus-per-process 1``: the target on core 0, the draft on core 1). Each method runs as its own
``python -m ssd_jax.decode --json`` and the table says whether its tokens equal AR's and, beside each
row, the plan's choice: its K, or AR rounds where no speculation is predicted to beat AR by more than
the planner's error (K auto). The launched SSD's plan also prices the layout against AR on both cores;
where that fails (the draft's core would serve AR better), the SSD row is run again in one process on
both cores, under that layout's own plan, and the row names both choices.

One prompt and one run each: an anecdote, not a benchmark (the benchmarks: docs/benchmarking.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROMPT = "Write a Python function that checks whether a number is prime."


def _run(cmd: list[str]) -> dict:
    from ssd_jax.errors import UserError

    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        tail = [ln for ln in p.stderr.splitlines() if ln.strip()][-3:]
        raise UserError(f"{' '.join(cmd[2:5])} failed (exit {p.returncode}): {' | '.join(tail)}")
    return json.loads(p.stdout)


def _commands(args) -> dict[str, list[str]]:
    from ssd_jax.drafters import default_draft

    py = [sys.executable, "-m"]
    common = [
        "--target",
        args.target,
        "--prompt",
        args.prompt,
        "--chat",
        "--max-new-tokens",
        str(args.tokens),
        "--json",
    ]
    ssd = [
        "--method",
        "ssd",
        "--draft",
        default_draft(args.target, "ssd"),
        "--target-devices",
        "1",
        "--draft-devices",
        "1",
    ]
    launch = ["ssd_jax.launch", "--processes", "2", "--cpus-per-process", "1"]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "ar": [*py, "ssd_jax.decode", *common],
        "sd": [*py, "ssd_jax.decode", *common, "--method", "sd", "--draft", default_draft(args.target, "sd")],
        "ssd": [*py, *launch, "decode", *common, *ssd]
        if cpus >= 2
        else [*py, "ssd_jax.decode", *common, *ssd[:4]],
        "ssd-one-process": [*py, "ssd_jax.decode", *common, *ssd[:4]],
    }


def _declined_launch(result: dict) -> bool:
    """Whether SSD's launched run is predicted below AR on both cores by the planner's margin
    (``plan.predicted.ar_reference.pays``, planning/reference.py): the second core then serves AR better
    than SSD's draft, and SSD belongs in one process on both."""
    ref = ((result["metrics"].get("plan") or {}).get("predicted") or {}).get("ar_reference") or {}
    return ref.get("pays") is False


def table(results: dict[str, dict]) -> str:
    """The demo's table; ``plan``: the plan's choice for the row (``Plan.choice``: e.g. "sd K=3 (predicted
    1.40x)", or "AR rounds (predicted 0.59x)" where no speculation is predicted to beat AR by more than
    the planner's error, the row then AR's rounds)."""
    ar = results["ar"]["outputs"][0]["token_ids"]
    lines = [
        "| method | draft | plan | decode tok/s | end-to-end tok/s | acceptance | hit rate | same tokens as AR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, d in results.items():
        m = d["metrics"]
        acc, hit = m.get("acceptance_rate"), m.get("cache_hit_rate")
        plan = {} if name == "ar" else m.get("plan") or {}
        if plan.get("chosen", {}).get("ar_rounds"):  # nothing proposed: no acceptance, no hits to show
            acc = hit = None
        plan = plan.get("choice") or "-"
        lines.append(
            f"| {name} | {m.get('draft') or '-'} | {plan} | {m['decode_tokens_per_s']:.1f} | {m['tokens_per_s']:.1f} "
            f"| {'-' if acc is None else f'{acc:.2f}'} | {'-' if hit is None else f'{hit:.2f}'} "
            f"| {'-' if name == 'ar' else ('yes' if d['outputs'][0]['token_ids'] == ar else 'NO')} |"
        )
    return "\n".join(lines)


def run(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssd_jax.demo", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    results, cmds = {}, _commands(args)
    one_process = cmds.pop("ssd-one-process")
    for name, cmd in cmds.items():
        print(f"[demo] {name} ...", file=sys.stderr, flush=True)
        results[name] = _run(cmd)
    if _declined_launch(launched := results["ssd"]):  # SSD where its plan puts it: one process, all cores
        print(f"[demo] ssd, launched: {launched['metrics']['plan']['line']}", file=sys.stderr)
        print(
            "[demo] ssd again in one process (its plan there: AR rounds on every core, or SSD) ...",
            file=sys.stderr,
        )
        results["ssd"] = _run(one_process)
        plan = results["ssd"]["metrics"].get("plan") or {}
        ref = launched["metrics"]["plan"]["predicted"]["ar_reference"]
        own = f"{launched['metrics']['plan']['choice']}, {ref['expected_speedup']:.2f}x AR on both"
        plan["choice"] = f"{plan.get('choice', '-')}, one process (on its own core: {own})"
    print(f"\n{args.prompt}\n\n{results['ar']['outputs'][0]['text'].strip()}\n")
    print(table(results))
    print("\nOne prompt, one greedy run each (an anecdote; the benchmarks: docs/benchmarking.md).")
    same = all(
        d["outputs"][0]["token_ids"] == results["ar"]["outputs"][0]["token_ids"] for d in results.values()
    )
    return 0 if same else 1


def main(argv=None) -> int:
    from ssd_jax.errors import cli_main

    return cli_main(run, argv)
