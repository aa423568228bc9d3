"""Before / after of the engine redesign in one run: ``engine_probe.py`` on the code of two
revisions, alternating (before, after, before, after, ...) so both see the same machine load.

    .venv/bin/python experiments/probes/engine_compare.py --before 2776dae [--alternations 2] [--smollm]

The "after" side is this working tree. Writes experiments/results/engine_probe.jsonl and
experiments/results/engine_probe.md (tables: decode tok/s with 95% intervals over repeats, ratios to AR,
compiled calls and milliseconds per round, host cost per token against length).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments" / "results" / "engine_probe.jsonl"
DOC = ROOT / "experiments" / "results" / "engine_probe.md"
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def ci(xs):
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T95.get(len(xs) - 1, 2.0) * statistics.stdev(xs) / math.sqrt(len(xs))


def run_side(tag, pythonpath, args, extra):
    env = dict(os.environ, PYTHONPATH=pythonpath)
    cmd = [
        sys.executable,
        str(ROOT / "experiments" / "engine_probe.py"),
        "--out",
        str(OUT),
        "--tag",
        tag,
        "--tokens",
        str(args.tokens),
        "--repeats",
        str(args.repeats),
        *extra,
    ]
    print("+", tag, " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, env=env, check=True, cwd=pythonpath)


def render(rows) -> str:
    tags = [t for t in ("before", "after") if any(r["tag"] == t for r in rows)]
    lines = [
        "# Engine redesign: host cost before and after",
        "",
        "Written by `experiments/probes/engine_compare.py` (probe: `experiments/probes/engine_probe.py`). Both sides ran in",
        "one session, alternating, on the 2-core development CPU (jax "
        f"{rows[0]['jax']}); `before` = commit {next(r['commit'] for r in rows if r['tag'] == 'before')}, "
        f"`after` = commit {next(r['commit'] for r in rows if r['tag'] == 'after')} plus the working tree "
        "at the time of the run. Load average (1 min) during the runs: "
        f"{min(r['loadavg_now'] for r in rows):.2f}-{max(r['loadavg_now'] for r in rows):.2f}.",
        "",
        "## Probe: 2 layers, width 64, vocabulary 128, draft = target (every proposal accepted), K = 3, "
        f"{rows[0]['tokens']} tokens, batch 1, greedy",
        "",
        "Decode tok/s: mean ± 95% interval over the repeats (each repeat runs the four methods back to back).",
        "",
        "| side | method | decode tok/s | × AR | compiled calls / round | ms / round | ms / token |",
        "|---|---|---|---|---|---|---|",
    ]
    for tag in tags:
        probe = [r for r in rows if r["tag"] == tag and r["suite"] == "probe"]
        ar = statistics.fmean(r["decode_tok_s"] for r in probe if r["method"] == "ar")
        for method in ("ar", "sd", "ssd", "ngram"):
            rr = [r for r in probe if r["method"] == method]
            if not rr:
                continue
            m, h = ci([r["decode_tok_s"] for r in rr])
            lines.append(
                f"| {tag} | {method} | {m:.0f} ± {h:.0f} (n={len(rr)}) | {m / ar:.2f} | "
                f"{statistics.fmean(r['calls_per_round'] for r in rr):.2f} | "
                f"{statistics.fmean(r['ms_per_round'] for r in rr):.2f} | "
                f"{statistics.fmean(r['ms_per_token'] for r in rr):.3f} |"
            )
    lengths = sorted({r["tokens"] for r in rows if r["suite"] == "length"})
    if lengths:
        lines += [
            "",
            "## Host cost per token against length (2 layers, width 64, SmolLM2's vocabulary and tokenizer, "
            "so detokenisation counts; greedy, batch 1)",
            "",
            "ms per generated token (decode only); flat = constant host work per token.",
            "",
            "| side | method | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
            "|---|---|" + "---|" * len(lengths),
        ]
        for tag in tags:
            for method in ("ar", "sd"):
                cells = []
                for n in lengths:
                    rr = [
                        r["ms_per_token"]
                        for r in rows
                        if r["tag"] == tag
                        and r["suite"] == "length"
                        and r["method"] == method
                        and r["tokens"] == n
                    ]
                    cells.append(f"{statistics.fmean(rr):.2f}" if rr else "-")
                lines.append(f"| {tag} | {method} | " + " | ".join(cells) + " |")
    for suite in sorted({r["suite"] for r in rows if r["suite"].startswith("smollm")}):
        lines += [
            "",
            f"## SmolLM2-135M + shipped draft, {suite.split('-b')[1]} rows, 32 tokens, greedy, K = 3",
            "",
            "| side | method | decode tok/s | × AR | end-to-end tok/s | calls / round | ms / round |",
            "|---|---|---|---|---|---|---|",
        ]
        for tag in tags:
            rr_all = [r for r in rows if r["tag"] == tag and r["suite"] == suite]
            if not rr_all:
                continue
            ar = statistics.fmean(r["decode_tok_s"] for r in rr_all if r["method"] == "ar")
            for method in ("ar", "sd", "ngram", "ssd"):
                rr = [r for r in rr_all if r["method"] == method]
                m, h = ci([r["decode_tok_s"] for r in rr])
                e, _ = ci([r["e2e_tok_s"] for r in rr])
                lines.append(
                    f"| {tag} | {method} | {m:.1f} ± {h:.1f} (n={len(rr)}) | {m / ar:.2f} | {e:.1f} | "
                    f"{statistics.fmean(r['calls_per_round'] for r in rr):.2f} | "
                    f"{statistics.fmean(r['ms_per_round'] for r in rr):.1f} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="2776dae")
    p.add_argument("--alternations", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--smollm", action="store_true")
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args()
    if not args.render_only:
        OUT.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory() as before:
            arch = subprocess.run(
                ["git", "archive", args.before], cwd=ROOT, capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "x", "-C", before], input=arch, check=True)
            subprocess.run(["git", "init", "-q"], cwd=before, check=True)  # so the probe can name the commit
            for i in range(args.alternations):
                extra = ["--lengths", "256", "512", "1024", "2048"] if i == 0 else ["--lengths"]
                if args.smollm and i == 0:
                    extra.append("--smollm")
                for tag, path in (("before", before), ("after", str(ROOT))):
                    run_side(tag, path, args, extra)
    rows = [json.loads(x) for x in OUT.read_text().splitlines() if x.strip()]
    for r in rows:
        if r["tag"] == "before" and not r["commit"]:
            r["commit"] = args.before
    DOC.write_text(render(rows))
    print(DOC.read_text())


if __name__ == "__main__":
    main()
