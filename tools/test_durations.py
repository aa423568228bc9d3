"""Per-file seconds of a test run: ``python tools/test_durations.py FILE [--top N]``.

FILE is what a run with ``SSD_JAX_TEST_DURATIONS=FILE`` wrote (tests/conftest.py: one line per test
phase, ``nodeid<TAB>phase<TAB>seconds<TAB>outcome<TAB>XLA compile seconds``). Prints a markdown table of
files by their summed seconds (setup, call and teardown), with their tests, failures and the seconds the
test process spent compiling (a subprocess's compilations are not counted), then the N slowest phases.
"""

from __future__ import annotations

import argparse
import collections


def read(path: str) -> list[tuple[str, str, float, str, float]]:
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) in (4, 5):  # (files written before the compile column have 4)
                compile_s = float(parts[4]) if len(parts) == 5 else 0.0
                rows.append((parts[0], parts[1], float(parts[2]), parts[3], compile_s))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    rows = read(a.file)
    secs, tests, failed = collections.Counter(), collections.defaultdict(set), collections.Counter()
    comp = collections.Counter()
    for nodeid, phase, s, outcome, c in rows:
        name = nodeid.split("::")[0].removeprefix("tests/").removesuffix(".py")
        secs[name] += s
        comp[name] += c
        if phase == "call":
            tests[name].add(nodeid)
        failed[name] += outcome == "failed"
    print("| file | tests | s | compiling, s | failed |\n|---|---|---|---|---|")
    for name, s in secs.most_common():
        print(f"| {name} | {len(tests[name])} | {s:.1f} | {comp[name]:.1f} | {failed[name] or ''} |")
    n = sum(len(t) for t in tests.values())
    print(f"| **all** | {n} | {sum(secs.values()):.1f} | {sum(comp.values()):.1f} | {sum(failed.values())} |")
    print(f"\nslowest {a.top} phases:")
    for nodeid, phase, s, _, c in sorted(rows, key=lambda r: -r[2])[: a.top]:
        print(f"{s:8.1f}  {c:6.1f}  {phase:8s}  {nodeid}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
