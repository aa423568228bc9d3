"""Power of the engine-level goodness-of-fit test (tests/test_exactness.py), by simulation.

Takes the exact conditionals of every token of a real SD run (the tests' partly agreeing
pair, T = 1, K = 4, 32 tokens per row) at the default and at the slow sample size, redraws
every token from a distribution at a known total-variation distance delta from its
conditional, and counts how often the test (pooled + per-offset PIT chi-square, Bonferroni,
family-wise alpha 1e-4) rejects. delta = 0 gives the false-rejection rate.

    .venv/bin/python experiments/exactness_power.py   # about 1 minute on 2 cores

Writes experiments/results/exactness_power.{json,md}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402
from reference import goodness_of_fit  # noqa: E402
from test_exactness import N_ROWS, T1, noisy_copy, run_and_score, tiny_model  # noqa: E402

DELTAS = [0.0, 0.01, 0.02, 0.03, 0.05, 0.08]
REPEATS = 40


def main() -> None:
    target = tiny_model(7, vocab=16, scale=0.3, layers=2)
    pair = (target, noisy_copy(target, 0.01, seed=1))
    rows = []
    for n_rows in (N_ROWS, 8 * N_ROWS):
        _, m, em = run_and_score(pair, "sd", "model", 1.0, T1, seed=100, n_rows=n_rows)
        for kind in ("to_top", "to_tail"):
            for d in DELTAS:
                rej = sum(goodness_of_fit(em.biased(d, kind, np.random.default_rng(1000 + r)), seed=r).rejected
                          for r in range(REPEATS))
                rows.append({"tokens": len(em.tokens), "rows": 4 * n_rows, "kind": kind, "tv": d,
                             "rejection_rate": rej / REPEATS, "repeats": REPEATS})
                print(rows[-1], flush=True)
    out = ROOT / "experiments" / "results"
    (out / "exactness_power.json").write_text(json.dumps(rows, indent=1))
    lines = ["# Power of the engine-level goodness-of-fit test", "",
             f"Rejection rate over {REPEATS} simulated runs, family-wise alpha 1e-4 (written by "
             "experiments/exactness_power.py). `to_top`: delta of the mass moved onto the most likely token; "
             "`to_tail`: delta moved off it onto the rest, in proportion. TV = total-variation distance per token.", "",
             "| tokens | bias | " + " | ".join(f"TV {d}" for d in DELTAS) + " |",
             "|---|---|" + "---|" * len(DELTAS)]
    for n in sorted({r["tokens"] for r in rows}):
        for kind in ("to_top", "to_tail"):
            rr = [r for r in rows if r["tokens"] == n and r["kind"] == kind]
            lines.append(f"| {n} | {kind} | " + " | ".join(f"{r['rejection_rate']:.2f}" for r in rr) + " |")
    (out / "exactness_power.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
