"""Power of the engine-level goodness-of-fit test (tests/test_exactness.py), by simulation.

Takes the exact conditionals of every token of a real SD run (the tests' partly agreeing
pair, T = 1, K = 4, 32 tokens per row) at the default and at the slow sample size, redraws
every token from a distribution at a known total-variation distance delta from its
conditional, and counts how often the test (pooled + per-offset PIT chi-square, Bonferroni,
family-wise alpha 1e-4; chi-square and Kolmogorov-Smirnov) rejects. delta = 0 gives the false-rejection rate. The unit-level
chi-square tests (test_verify's Monte Carlo, the slow 20k-row SD/SSD tests) get the same
treatment on their exact enumerated distributions.

    .venv/bin/python experiments/probes/exactness_power.py   # about 1 minute on 2 cores

Writes experiments/results/exactness_power.{json,md}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402
from reference import goodness_of_fit  # noqa: E402
from test_exactness import N_ROWS, T1, noisy_copy, run_and_score, tiny_model  # noqa: E402

DELTAS = [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.08]
REPEATS = 40


def _redraw(p: np.ndarray, delta: float, kind: str, n: int, rng) -> np.ndarray:
    """n draws (cell indices) from p with delta of its mass moved onto / off its most likely cell."""
    top = int(np.argmax(p))
    rest = p.copy()
    rest[top] = 0.0
    rest /= rest.sum()
    d = min(delta, 1 - p[top]) if kind == "to_top" else min(delta, p[top] * 0.999)
    q = p + (d if kind == "to_top" else -d) * (np.eye(len(p))[top] - rest)
    return rng.choice(len(p), size=n, p=np.clip(q, 0, None) / np.clip(q, 0, None).sum())


def unit_level_rows() -> list[dict]:
    """The chi-square tests of test_verify (20,000 rows, the joint of the first 2 tokens over 8^2 cells) and of
    test_sd / test_ssd (slow set; 20,000 rows, tokens 2 and 3 over 16^2 cells), same bias families."""
    import test_sd
    import test_verify as tv

    from ssd_jax import SamplingParams
    from ssd_jax.sampling.filters import RowSampling

    rows = []
    p_verify = tv._exact_dist(RowSampling.broadcast(SamplingParams(temperature=1.0), 1), True, 2)
    target = test_sd.tiny_model(3, vocab=test_sd.V_SMALL, scale=0.3, layers=1)  # conftest.small_pair's target
    sp = SamplingParams(temperature=1.0)
    p_pair = test_sd.exact_pair_distribution(target, [3, 7, 1], RowSampling.broadcast(sp, 1), False).ravel()
    for name, p, V, n_tok in (
        ("test_verify Monte Carlo (t1)", p_verify, tv.V, 2),
        ("test_sd/test_ssd 20k pairs (slow)", p_pair, test_sd.V_SMALL, 2),
    ):
        for kind in ("to_top", "to_tail"):
            for d in DELTAS:
                rej = 0
                for r in range(REPEATS):
                    cells = _redraw(p, d, kind, 20_000, np.random.default_rng(r))
                    toks = np.stack(np.unravel_index(cells, (V,) * n_tok), axis=1)
                    if name.startswith("test_verify"):
                        stat, thr = tv._chi2(toks, p)
                    else:
                        counts = np.bincount(cells, minlength=len(p))
                        stat, df = test_sd.chi2_stat(counts, p, 20_000)
                        thr = test_sd.chi2_threshold(df)
                    rej += stat > thr
                rows.append(
                    {
                        "test": name,
                        "tokens": 20_000,
                        "kind": kind,
                        "tv": d,
                        "rejection_rate": rej / REPEATS,
                        "repeats": REPEATS,
                    }
                )
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    target = tiny_model(7, vocab=16, scale=0.3, layers=2)
    pair = (target, noisy_copy(target, 0.01, seed=1))
    rows = []
    for n_rows in (N_ROWS, 8 * N_ROWS):
        _, m, em = run_and_score(pair, "sd", "model", 1.0, T1, seed=100, n_rows=n_rows)
        for kind in ("to_top", "to_tail"):
            for d in DELTAS:
                rej = sum(
                    goodness_of_fit(em.biased(d, kind, np.random.default_rng(1000 + r)), seed=r).rejected
                    for r in range(REPEATS)
                )
                rows.append(
                    {
                        "tokens": len(em.tokens),
                        "rows": 4 * n_rows,
                        "kind": kind,
                        "tv": d,
                        "rejection_rate": rej / REPEATS,
                        "repeats": REPEATS,
                    }
                )
                print(rows[-1], flush=True)
    for r in rows:
        r["test"] = "test_exactness goodness of fit (per token)"
    rows += unit_level_rows()
    out = ROOT / "experiments" / "results"
    (out / "exactness_power.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# Power of the engine-level goodness-of-fit test",
        "",
        f"Rejection rate over {REPEATS} simulated runs, family-wise alpha 1e-4 (written by "
        "experiments/probes/exactness_power.py). `to_top`: delta of the mass moved onto the most likely token; "
        "`to_tail`: delta moved off it onto the rest, in proportion. TV = total-variation distance per token.",
        "",
        "For the unit-level chi-square tests the bias is applied to the joint distribution of the tokens "
        "they test (TV on that joint).",
        "",
        "| test | samples | bias | " + " | ".join(f"TV {d}" for d in DELTAS) + " |",
        "|---|---|---|" + "---|" * len(DELTAS),
    ]
    groups = []
    for r in rows:
        g = (r["test"], r["tokens"], r["kind"])
        if g not in groups:
            groups.append(g)
    for test, n, kind in groups:
        rr = [r for r in rows if (r["test"], r["tokens"], r["kind"]) == (test, n, kind)]
        lines.append(
            f"| {test} | {n} | {kind} | " + " | ".join(f"{r['rejection_rate']:.2f}" for r in rr) + " |"
        )
    (out / "exactness_power.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
