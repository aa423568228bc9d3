"""``python -m ssd_jax.bench``: benchmarks that write results files (never asserted in tests).

Suites ``ar``, ``sd`` and ``ssd`` (:mod:`ssd_jax.bench.suites`) write
``experiments/results/<suite>_<backend>.json`` and a markdown table beside it. Suites ``smoke``
and ``paper`` are lists of resumable sweeps (:data:`ssd_jax.bench.sweep.SUITES`):
``python -m ssd_jax.bench --suite smoke`` writes ``experiments/results/smoke/`` (one JSON line
per configuration, markdown tables and plots, an index ``README.md``).

Suite ``protocol`` (:mod:`ssd_jax.bench.protocol`) is the benchmark protocol every speed
claim follows: ``--methods ar sd:4 ngram:4 ssd:4`` interleaved per prompt, >= 8 prompts per
category (code, chat, math, copy), >= 3 repeats, batch sizes ``--batch-sizes 1 16``; it writes
``experiments/results/protocol_<backend>[_<tag>].{jsonl,md}`` and resumes a killed run.
``--protocol-report FILE.jsonl`` re-renders its table.

Suite ``acceptance`` (:mod:`ssd_jax.bench.acceptance`): the draft's acceptance by position and
category on the benchmark prompts at ``--temperatures`` (default 0 1) and ``--ks`` (default 4),
written to ``experiments/results/acceptance_<backend>[_<tag>].{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ssd_jax.bench import protocol, suites, sweep
from ssd_jax.bench.suites import DEFAULT_MODELS
from ssd_jax.cli.args import Parser
from ssd_jax.errors import cli_main


def _suite_defaults(args, argv, defaults: dict) -> None:
    """A suite's own defaults (flag -> (attribute, value)) for the flags not given on the command line."""
    given = argv if argv is not None else sys.argv[1:]
    for flag, (attr, val) in defaults.items():
        if flag not in given:
            setattr(args, attr, val)


def build_parser() -> Parser:
    p = Parser(prog="python -m ssd_jax.bench")
    p.add_argument(
        "--suite",
        default="ar",
        choices=["ar", "sd", "ssd", "smoke", "paper", "protocol", "acceptance"],
        help="ar/sd/ssd: the per-method benchmarks; smoke/paper: built-in sweep suites (ssd_jax/bench/sweep.py) "
        "written to <out>/<suite>/ with a report",
    )
    p.add_argument("--ssd-k", type=int, default=4)
    p.add_argument("--parts", nargs="+", default=["main", "fanout", "saguaro", "batch"])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--ngram-k", type=int, default=4)
    p.add_argument("--n-prompts", type=int, default=3)
    p.add_argument("--categories", nargs="+", default=["code", "chat", "math"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default="experiments/results")
    p.add_argument("--tag", default="", help="suffix of the results file name (e.g. the model pair)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=["ar", "sd:4", "ngram:4", "ssd:4"],
        help="protocol: methods to interleave (ar, sd:K, ngram:K, ssd:K; K an integer or auto; "
        "the draft vocabulary and dtype are auto (the defaults) unless :vN (trim to N) / :full and :bf16 / :f32 say; sd:K@DRAFT uses DRAFT instead of --draft, so drafts "
        "can be compared in one run); ar is required",
    )
    p.add_argument(
        "--order", default="rotate", choices=list(protocol.ORDERS), help="protocol: per-unit method order"
    )
    p.add_argument("--seed", type=int, default=0, help="protocol: seed of --order shuffle")
    p.add_argument(
        "--chat", action="store_true", help="protocol, acceptance: wrap prompts in the target's chat template"
    )
    p.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="acceptance: sampling temperatures"
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="protocol: read bandwidth in GB/s for the AR roofline (default: measured)",
    )
    p.add_argument(
        "--protocol-report", metavar="RESULTS_JSONL", help="re-render a protocol results file's table"
    )
    p.add_argument("--child-ar", help=argparse.SUPPRESS)
    p.add_argument(
        "--render", metavar="RESULTS_JSON", help="only re-render the markdown table of a results file"
    )
    p.add_argument(
        "--sweep",
        metavar="CONFIG_JSON",
        help="run (or resume) a sweep: one JSON line per configuration "
        "in <out>/<name>.jsonl, then its report (see ssd_jax/bench/sweep.py)",
    )
    p.add_argument("--report", metavar="RESULTS_JSONL", help="render a sweep's markdown table and plot")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="protocol: run as one process of a jax.distributed run (set by python -m ssd_jax.launch ... "
        "bench): the hardware-fair protocol, SSD's draft in process 1, every other method in process 0",
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.sweep or args.report or args.suite in ("smoke", "paper"):
        return _sweeps(args, argv)
    if args.render:
        suites.rerender(args.render)
        return 0
    if args.protocol_report:
        print(f"wrote {protocol.write_report(args.protocol_report)}", file=sys.stderr)
        return 0
    if args.suite in ("protocol", "acceptance"):
        return _protocol_suite(args, argv)
    if args.distributed:
        raise SystemExit("error: --distributed runs the protocol suite only (--suite protocol)")
    if args.child_ar:
        print(json.dumps(suites.ar_one(args.child_ar, args.new_tokens, args.dtype, args.repeats)))
        return 0
    return _method_suite(args, argv)


def _sweeps(args, argv) -> int:
    """``--sweep`` (run or resume one, then its report), ``--report`` (a sweep's report) or the sweep
    suites ``smoke`` / ``paper`` (``--target`` / ``--draft``, when given, override theirs)."""
    given = argv if argv is not None else sys.argv[1:]
    override = {k: getattr(args, k) for k in ("target", "draft") if f"--{k}" in given}

    def go(_):
        if args.sweep or args.report:
            path = sweep.run_sweep(args.sweep, args.out) if args.sweep else args.report
            written = " and ".join(str(x) for x in sweep.report(path) if x)
        else:
            written = sweep.run_suite(args.suite, args.out, **override)
        print(f"wrote {written}", file=sys.stderr)
        return 0

    return cli_main(go, None)


def _protocol_suite(args, argv) -> int:
    """Suites ``protocol`` and ``acceptance``, with the protocol's defaults (acceptance: K = 4, not a
    batch size); ``--distributed``: one process of the hardware-fair protocol."""
    from ssd_jax.bench import acceptance

    own = {"--ks": ("ks", [4])} if args.suite == "acceptance" else {"--batch-sizes": ("batch_sizes", [1])}
    _suite_defaults(
        args,
        argv,
        {
            "--n-prompts": ("n_prompts", 8),
            "--categories": ("categories", list(protocol.CATEGORIES)),
            "--new-tokens": ("new_tokens", 64),
            **own,
        },
    )
    mod = acceptance if args.suite == "acceptance" else protocol

    def go(_):
        print(f"wrote {mod.suite(args)}", file=sys.stderr)
        return 0

    if args.distributed and args.suite == "protocol":
        from ssd_jax.cli.decode import run_distributed

        return run_distributed(go, args)
    return cli_main(go, None)


def _method_suite(args, argv) -> int:
    """Suites ``ar``, ``sd`` and ``ssd``: the results JSON and its markdown table."""
    if args.suite in ("sd", "ssd") and "--new-tokens" not in (argv or sys.argv):
        args.new_tokens = 64
    res = {"ar": suites.suite_ar, "sd": suites.suite_sd, "ssd": suites.suite_ssd}[args.suite](args)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(
        args.out, f"{res['suite']}_{res['env']['backend']}" + (f"_{args.tag}" if args.tag else "")
    )
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(suites.render(res))
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
