"""The acceptance-by-position curves of several drafts on one plot, from ``--suite acceptance`` results.

    python experiments/probes/acceptance_plot.py experiments/results/eagle/acceptance_cpu_smollm2_head.json \
        experiments/results/eagle/acceptance_cpu_smollm2_draft.json --out experiments/results/eagle/acceptance_smollm2.png

For each results file and temperature: P(at least j of the K proposals accepted) over all categories
(``at_least`` of the ``all`` cell), j = 1..K, labelled with the draft and its acceptance
(and the results file, where two files hold versions of one draft).
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+", help="acceptance_*.json files")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    loaded = [(path, json.load(open(path))) for path in a.results]
    names = [r["draft"] for _, r in loaded]
    for path, res in loaded:
        name = res["draft"]
        if names.count(name) > 1:  # two versions of one draft: tell them apart by their results file
            name += f" ({os.path.basename(path).removesuffix('.json')})"
        for c in res["cells"]:
            if c["category"] != "all":
                continue
            xs = list(range(1, len(c["at_least"]) + 1))
            ls = "-" if c["temperature"] == 0 else "--"
            label = f"{name}, T={c['temperature']:g} (acceptance {c['acceptance']:.2f})"
            ax.plot(xs, c["at_least"], ls, marker="o", label=label)
    ax.set_xlabel("j (proposal position)")
    ax.set_ylabel("P(at least j proposals accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(a.out)


if __name__ == "__main__":
    main()
