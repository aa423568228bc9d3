"""The before / after table of ``engine_before_after.py`` results (markdown on stdout).

    python experiments/probes/engine_report.py experiments/results/engine/smollm2.json [...]

Per pair, method and batch: mean decode and end-to-end tokens/s of each checkout, and the paired ratio
after / before (each call paired with the other checkout's same call; a prompt's repeats averaged in
log space first, so the interval is over prompts) with its 95% t-interval. Then the tiny model's
host cost per AR step and per SD round: mean and 95% interval of each, and their ratio.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from ssd_jax.bench.stats import clustered, mean_ci, ratio_ci


def _fmt(ci) -> str:
    return f"{ci[0]:.3f}x [{ci[1]:.3f}, {ci[2]:.3f}]"


def report(path: str) -> str:
    d = json.load(open(path))
    calls = d["calls"]
    keyed = defaultdict(dict)
    for c in calls:
        if not c["method"].startswith("tiny"):
            keyed[(c["method"], c["batch"], c["category"], c["prompt"], c["repeat"])][c["version"]] = c
    lines = [
        f"### {d['pair']} ({d['conf'][0]} / {d['conf'][1]}; SD K {d['conf'][2]}, SSD K {d['conf'][3]} "
        f"budget {d['conf'][4]}, draft dtype {d['conf'][5] or 'target'}; {d['conf'][6]} new tokens)",
        "",
        "| method | batch | decode tok/s before → after | after / before, decode | e2e tok/s before → after "
        "| after / before, e2e | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in ("ar", "sd", "ssd"):
        for batch in sorted({k[1] for k in keyed}):
            pairs = {k: v for k, v in keyed.items() if k[0] == method and k[1] == batch and len(v) == 2}
            if not pairs:
                continue
            row = [method.upper(), str(batch)]
            for field in ("decode_tokens_per_s", "tokens_per_s"):
                b = mean_ci([v["before"][field] for v in pairs.values()])[0]
                a = mean_ci([v["after"][field] for v in pairs.values()])[0]
                ratios = clustered(
                    (((k[2], k[3]), v["after"][field] / v["before"][field]) for k, v in pairs.items()),
                    log=True,
                )
                row += [f"{b:.2f} → {a:.2f}", _fmt(ratio_ci(ratios))]
            loads = [v[x]["load"] for v in pairs.values() for x in ("before", "after")]
            row.append(f"{min(loads):.1f}-{max(loads):.1f}")
            lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "| tiny model, batch 1 | before, ms [95% CI] | after, ms [95% CI] | after / before |",
        "|---|---|---|---|",
    ]
    for method, name in (("tiny_ar", "host cost per AR step"), ("tiny_sd", "host cost per SD round")):
        per = {
            v: [c["s_per_step"] * 1e3 for c in calls if c["method"] == method and c["version"] == v]
            for v in ("before", "after")
        }
        if not per["before"]:
            continue
        b, a = mean_ci(per["before"]), mean_ci(per["after"])
        lines.append(
            f"| {name} | {b[0]:.3f} [{b[1]:.3f}, {b[2]:.3f}] | {a[0]:.3f} [{a[1]:.3f}, {a[2]:.3f}] | {a[0] / b[0]:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(report(p) for p in sys.argv[1:]))
