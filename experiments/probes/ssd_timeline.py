"""One SSD run's round timeline, from its trace (``--trace FILE`` on a two-process run).

    .venv/bin/python experiments/probes/ssd_timeline.py TRACE.json [TRACE.json ...]

Prints one JSON object per trace: per stage (verify and sample on the target's lane; build,
advance and the neural fallback on the draft's) the median milliseconds; the round (one verify
start to the next); the target's idle time waiting for the draft (from the end of its sample to
the end of the advance that produced its next speculation, when that is later); and the overlap
(the share of the target's verify time during which the draft was building).

The traced run separates the stages into one call each and waits for each (as
``--profile-stages`` does), so its rounds are a little slower than an untraced run's."""

import json
import sys

import numpy as np


def summarise(path: str) -> dict:
    ev = sorted(
        (e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"]
    )
    by = {}
    for e in ev:
        by.setdefault(e["name"], []).append(e)
    ms = {name: round(float(np.median([e["dur"] for e in es])) / 1e3, 1) for name, es in by.items()}
    verify, sample = by.get("verify", []), by.get("sample", [])
    advance, build = by.get("advance", []), by.get("build", [])
    rounds = [(b["ts"] - a["ts"]) / 1e3 for a, b in zip(verify, verify[1:])]
    idle = []
    for s in sample:  # the advance that follows this sample delivers the next speculation
        end = s["ts"] + s["dur"]
        nxt = [a for a in advance if a["ts"] + a["dur"] >= end]
        idle.append(max(0.0, (nxt[0]["ts"] + nxt[0]["dur"] - end) / 1e3) if nxt else 0.0)
    overl = tot = 0.0
    for v in verify:
        v0, v1 = v["ts"], v["ts"] + v["dur"]
        tot += v1 - v0
        overl += sum(max(0.0, min(v1, b["ts"] + b["dur"]) - max(v0, b["ts"])) for b in build)
    return {
        "trace": path,
        "rounds": len(verify),
        "median_ms": ms,
        "round_ms_median": round(float(np.median(rounds)), 1) if rounds else None,
        "target_idle_ms_median": round(float(np.median(idle)), 1) if idle else None,
        "target_idle_share": round(sum(idle) / sum(rounds), 3) if rounds else None,
        "overlap_fraction": round(overl / tot, 3) if tot else None,
    }


if __name__ == "__main__":
    print(json.dumps([summarise(p) for p in sys.argv[1:]], indent=1))
