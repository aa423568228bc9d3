"""SSD's host side: the fan-out layouts of a round (what the control vector carries), what crosses
to the target of a speculation, the trace's lanes (one per process and device set under
``jax.distributed``, merged on process 0) and the stage times of a profiled run. The round loop
itself is the engine's (:mod:`ssd_jax.engine.methods.ssd`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ssd_jax.decoding.ssd import fanout as fo
from ssd_jax.decoding.ssd.backup import row_schedule
from ssd_jax.decoding.ssd.rounds import META_FIELDS
from ssd_jax.decoding.trace import Timeline, lane_for
from ssd_jax.drafters.base import Proposal
from ssd_jax.parallel import distributed as dist


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _measure(iv) -> float:
    return sum(b - a for a, b in iv)


def _intersection(x, y) -> float:
    """Total length of the intersection of two disjoint, sorted interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        tot += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


def layout_table(est, K: int, M: int, uniform: bool):
    """Fan-out schedules and branch layouts for every row state (see :class:`.rounds.Control`)."""
    sched = np.stack(
        [est.schedule(False)] + [row_schedule(est, True, n, K, M, uniform) for n in range(K + 1)]
    )
    sched = sched.astype(np.int64)
    return (sched, *_branch_layouts(sched.tobytes(), sched.shape, M))


@functools.lru_cache(maxsize=64)
def _branch_layouts(sched_bytes: bytes, shape: tuple, M: int):
    """Branch layouts of a schedule table, cached: the schedules change rarely between rounds."""
    return fo.branch_layout(np.frombuffer(sched_bytes, np.int64).reshape(shape), M)


def fanout_setup(spec, n_draft_devices: int = 1):
    """(uniform?, branches per row M, the fan-out estimator) of a validated SSD spec with an integer K."""
    K = spec.k
    uniform = spec.fan_out != "geometric"
    if uniform:
        F = int(spec.fan_out)
        M = F * (K + 1)
    else:
        # default: two branches per acceptance position, rounded up to fill every draft device
        n_dd = n_draft_devices
        M = spec.fan_out_budget if spec.fan_out_budget is not None else -(-2 * (K + 1) // n_dd) * n_dd
    est = fo.FanoutEstimator(K, M, "uniform" if uniform else "geometric", uniform_F=F if uniform else None)
    return uniform, M, est


def spec_only(sp: Proposal) -> Proposal:
    return Proposal(sp.tokens, sp.n_draft, sp.q)


def spec_to_target(sp: Proposal, pl) -> Proposal:
    """What the target needs of a speculation (tokens, counts, q), on the target mesh."""
    if pl.single:
        return spec_only(sp)
    return pl.to_target(spec_only(sp))[0]


def lane(devices) -> str:
    """A trace lane per device set, named with its process(es) when there are several."""
    lane = lane_for(devices)
    if dist.multi_process():
        procs = ",".join(str(p) for p in sorted({d.process_index for d in devices}))
        lane = f"process {procs} {lane}"
    return lane


def merged_timeline(tl: Timeline, origin: float) -> Timeline | None:
    """A timeline of every process's events (times from the common origin), on process 0; None elsewhere."""
    mine = [
        dict(e, start=e["start"] - origin, end=e["end"] - origin, dispatch=e["dispatch"] - origin)
        for e in tl.events()
    ]
    every = dist.gather_to_main(mine)
    if every is None:
        return None
    out = Timeline(enabled=True)
    out.add_events([e for evs in every for e in evs])
    return out


def stage_metrics(tl, wall: float, ttft: float) -> dict:
    """Stage times from the timeline (profiled runs: --profile-stages or --trace)."""
    events = tl.events()
    dur = {}
    for e in events:
        dur[e["name"]] = dur.get(e["name"], 0.0) + (e["end"] - e["start"])
    # draft time the target waited for: draft work (build, advance, fallbacks) while the target
    # lane was idle; in single-device mode that is all of it, with perfect overlap none of it
    tgt = [(e["start"], e["end"]) for e in events if e["round"] > 0 and e["name"] in ("verify", "sample")]
    drf = [(e["start"], e["end"]) for e in events if e["round"] > 0 and e["name"] not in ("verify", "sample")]
    exposed = _measure(_union(drf)) - _intersection(_union(drf), _union(tgt))
    verify_s, sample_s = dur.get("verify", 0.0), dur.get("sample", 0.0)
    draft_s = sum(v for k_, v in dur.items() if k_ in ("build", "advance") or k_.startswith("fallback"))
    return {
        "draft_s": draft_s,
        "draft_exposed_s": exposed,
        "verify_s": verify_s,
        "sample_s": sample_s,
        "overhead_s": max(0.0, wall - ttft - verify_s - sample_s - exposed),
        "overlap_fraction": tl.overlap_fraction("verify", "build"),
    }


def run_metrics(m, wall: float, ttft: float, rounds: int) -> dict:
    """An SSD run's metrics (:meth:`ssd_jax.engine.methods.ssd.SSD.metrics`): hits, tokens per round,
    the fan-out estimators, backups, stage times of a profiled run and K = 0 rounds."""
    st = m.stats
    stages = m.stages.metrics(wall, ttft)
    return {
        "k": m.K,
        "draft": m.draft.name,
        **st.summary(),
        "fanout": m.fanout.summary(),
        "saguaro_c": float(m.spec.saguaro_c),
        "backup": m.spec.backup,
        "b_star": m.backup.b_star,
        "backup_model": m.backup.costs,
        **stages,
        "calls_per_round": m.calls / max(1, rounds),
        "k_rounds": {str(k): n for k, n in m.k_rounds.items()},
        "ar_buckets": sorted(m.ar_buckets),
        "bucket_costs": {str(b): c for b, c in m.bucket_costs.items()},
    }


def bucket_note(buckets, ar_buckets, costs: dict, k: int) -> str:
    """A server's account of SSD's choice per batch bucket, e.g. " by running rows 1: K=1 1.12x, 8: K=0
    (AR, 0.71x)" (the timed rounds' expected speedup over AR)."""
    out = []
    for b in buckets:
        x = costs.get(b, {}).get("expected_speedup")
        x = "" if x is None else f" {x:.2f}x"
        out.append(f"{b}: K=0 (AR{',' if x else ''}{x})" if b in ar_buckets else f"{b}: K={k}{x}")
    return " by running rows " + ", ".join(out)


@dataclasses.dataclass
class SpecMeta:
    """Per row, what the host knows of the speculation its next round verifies (the device's record of
    it, :data:`~ssd_jax.decoding.ssd.rounds.META_FIELDS`, read back by name)."""

    hit: np.ndarray  # (B,) bool: it came from the draft's cache (the lookup hit)
    post_miss: np.ndarray  # (B,) bool: a fast backup (random or n-gram) drafted it after a miss
    n_draft: np.ndarray  # (B,) int64: its proposals
    live: np.ndarray  # (B,) bool: the row ran on the device

    @classmethod
    def empty(cls, batch: int) -> SpecMeta:
        return cls(
            np.zeros(batch, bool), np.zeros(batch, bool), np.zeros(batch, np.int64), np.zeros(batch, bool)
        )

    @classmethod
    def read(cls, columns: np.ndarray) -> SpecMeta:
        """From a round's (B, META) host copy."""
        col = {name: np.asarray(columns[:, i]) for i, name in enumerate(META_FIELDS)}
        return cls(col["hit"] > 0, col["post_miss"] > 0, col["n_draft"].astype(np.int64), col["live"] > 0)

    def drafted(self, rows, k: int, post_miss: bool = False) -> None:
        """``rows`` (a mask or indices) got a speculation drafted anew, not found in the cache: ``k``
        proposals (by the fast backup when ``post_miss``)."""
        self.hit[rows], self.post_miss[rows], self.n_draft[rows], self.live[rows] = False, post_miss, k, True

    def updated(self, new: SpecMeta, keep: np.ndarray) -> SpecMeta:
        """A copy with ``new``'s rows, except the rows ``keep`` marks (admitted after the round: theirs)."""
        pairs = ((getattr(self, f.name), getattr(new, f.name)) for f in dataclasses.fields(self))
        return SpecMeta(*(np.where(keep, mine, theirs) for mine, theirs in pairs))

    @property
    def missed_on_device(self) -> np.ndarray:
        """Live rows whose lookup missed: the device ran the backup for them."""
        return ~self.hit & self.live


@dataclasses.dataclass
class SSDStats:
    """What SSD's host learns from its rounds, for model drafts and heads alike: hits and lookups per row,
    tokens per round after hits and misses, rounds where every row hit, fallbacks run."""

    batch: int
    hits: np.ndarray = None
    lookups: np.ndarray = None
    tau: dict = dataclasses.field(default_factory=lambda: {"hit": [0, 0], "miss": [0, 0]})
    batch_all_hit: list = dataclasses.field(default_factory=lambda: [0, 0])
    fallback_calls: dict = dataclasses.field(default_factory=lambda: {"neural": 0, "ngram": 0, "random": 0})
    pending: np.ndarray | None = None  # the last round's lookups' hits, counted when its rows settle

    def __post_init__(self):
        self.hits = np.zeros(self.batch, np.int64)
        self.lookups = np.zeros(self.batch, np.int64)

    def count_round(
        self, live: np.ndarray, n_acc: np.ndarray, cur: SpecMeta, nxt: SpecMeta, backup: str
    ) -> None:
        """A round over the ``live`` rows: it verified ``cur``'s speculations (``n_acc`` accepted) and
        looked up ``nxt``'s, where a miss ran the ``backup`` (neural, ngram or random) on the device."""
        emitted = n_acc + 1
        for name, sel in (("hit", cur.hit & live), ("miss", ~cur.hit & live)):
            self.tau[name][0] += int(emitted[sel].sum())
            self.tau[name][1] += int(sel.sum())
        if not live.any():
            return
        self.batch_all_hit[0] += int(nxt.hit[live].all())
        self.batch_all_hit[1] += 1
        self.pending = nxt.hit
        if (nxt.missed_on_device & live).any():
            self.fallback_calls[backup] += 1

    def settle(self, going: np.ndarray, prom=None) -> None:
        """The last round's lookups count for the rows that go on (``going``: their speculation is verified
        next); ``prom``: the server's Prometheus metrics, if any."""
        if self.pending is None:
            return
        hit = self.pending & going
        self.hits += hit
        self.lookups += going
        if prom is not None:
            prom.cache_lookup(int(going.sum()), int(hit.sum()))
        self.pending = None

    def row_metrics(self, b: int) -> dict:
        return {"cache_hit_rate": float(self.hits[b] / self.lookups[b]) if self.lookups[b] else 0.0}

    def summary(self) -> dict:
        """The run's hit rates, tokens per round after a hit and after a miss, and fallbacks."""
        tau = {k: v[0] / v[1] if v[1] else 0.0 for k, v in self.tau.items()}
        lookups = self.lookups.sum()
        return {
            "cache_hit_rate": float(self.hits.sum() / lookups) if lookups else 0.0,
            "batch_cache_hit_rate": self.batch_all_hit[0] / self.batch_all_hit[1]
            if self.batch_all_hit[1]
            else 0.0,
            "tau_hit": tau["hit"],
            "tau_miss": tau["miss"],
            "fallback_calls": dict(self.fallback_calls),
        }
