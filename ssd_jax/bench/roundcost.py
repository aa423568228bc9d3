"""The round-cost benchmark: what a round of AR, SD and SSD costs beyond its device work.

    python -m ssd_jax.roundcost --model tiny --out experiments/results/roundcost/tiny
    python -m ssd_jax.roundcost --model smollm2-135m-instruct --tokens 128 --out ...

For each method and layout it measures, per round, the wall time of the decoding loop (decode only:
compile and prefill excluded), the compiled calls the host dispatched, and the host syncs (device
values read on the host: ``np.asarray`` of a device array, ``jax.block_until_ready``). A second pass
with ``profile_stages`` times each stage as its own call (device time of the draft / build, verify and
sample stages, each waited for); the difference between a round's wall time and the sum of its stages'
is the round's fixed cost, the part a faster device does not remove.

The layouts: ``one`` (both models on one device), ``meshes`` (two fake CPU devices in one process: the
target on one, the draft on the other) and ``procs`` (two JAX processes on this machine through
``python -m ssd_jax.launch``, one core each, the draft in process 1). ``--model tiny`` is a 2-layer,
width-64 Llama with random weights and a 128-token vocabulary, its own draft (every proposal accepted,
compute about zero: the round's cost is the engine's); any registry name (e.g.
``smollm2-135m-instruct``) runs that target with its draft model (``--draft``, default the registry's
default draft model). Each layout runs in a child process of its own (the device count is fixed when JAX
starts); methods are interleaved within each repeat. Writes ``<out>.jsonl`` (one row per run) and
``<out>.md`` (medians and 95% intervals over the repeats).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import sys

METHODS = ("ar", "sd", "ssd")
LAYOUTS = ("one", "meshes", "procs")


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    draft: str | None
    tokens: int
    k: int
    repeats: int


def tiny_model(seed: int = 0):
    """The 2-layer, width-64 random Llama the engine's costs are measured on (the planner's own, which
    times SSD's fixed cost a round on it: :func:`ssd_jax.planning.overhead.tiny_model`)."""
    from ssd_jax.planning.overhead import tiny_model as tiny

    return tiny(seed)


def _models(case: Case):
    if case.model == "tiny":
        m = tiny_model()
        return m, m
    import ssd_jax
    from ssd_jax.drafters.vocab import load_with_head

    target = ssd_jax.load_model(case.model)
    return target, load_with_head(case.draft, dtype=target.cfg.dtype)


class Counters:
    """Compiled calls and host syncs, counted by wrapping the functions that make them: a sync is a
    method's ``read`` of a round's results (its device-to-host copy) or a ``jax.block_until_ready``."""

    def __init__(self):
        import jax

        import ssd_jax.engine.methods.eagle_ssd  # noqa: F401 - every method class, to count its reads
        import ssd_jax.engine.methods.ssd  # noqa: F401
        from ssd_jax.compile import Compiled
        from ssd_jax.engine.methods.base import Method

        self.calls = self.syncs = 0
        call, block = Compiled.__call__, jax.block_until_ready

        def counted_call(c, *a):
            self.calls += 1
            return call(c, *a)

        def counted_block(x):
            self.syncs += 1
            return block(x)

        Compiled.__call__, jax.block_until_ready = counted_call, counted_block
        todo, seen = [Method], set()
        while todo:  # every method class's own read
            cls = todo.pop()
            todo += cls.__subclasses__()
            if "read" in cls.__dict__ and cls not in seen:
                seen.add(cls)
                cls.read = self._counted(cls.__dict__["read"])

    def _counted(self, fn):
        def read(method, *a, **kw):
            self.syncs += 1
            return fn(method, *a, **kw)

        return read

    def reset(self) -> None:
        self.calls = self.syncs = 0


def _spec(method: str, draft, layout: str, k: int, profile: bool):
    from ssd_jax import SpecConfig

    if method == "ar":
        return SpecConfig()
    devices = {} if layout == "one" else {"target_devices": 1, "draft_devices": 1}
    extra = {"backup": "neural"} if method == "ssd" else {}
    return SpecConfig(
        method=method, draft=draft, k=k, draft_dtype=None, draft_vocab=None, profile_stages=profile,
        **devices, **extra,
    )  # fmt: skip


def _one_run(target, spec, case: Case, counters: Counters, prompt) -> dict:
    """One generation; per round: wall ms, compiled calls, host syncs (counted from the first round on)."""
    from ssd_jax import SamplingParams, generate

    sp = SamplingParams(max_new_tokens=case.tokens, ignore_eos=True)
    counters.reset()
    res = generate(target, [prompt], sp, spec)
    m = res.metrics
    rounds = max(1, m.get("verify_steps", m.get("steps", case.tokens)))
    decode = m["wall_s"] - m["ttft_s"]
    row = {
        "rounds": rounds,
        "tokens": m["generated_tokens"],
        "round_ms": 1e3 * decode / rounds,
        "decode_tok_s": m["decode_tokens_per_s"],
        "calls_per_round": counters.calls / rounds,
        "syncs_per_round": counters.syncs / rounds,
        "acceptance_rate": m.get("acceptance_rate"),
        "cache_hit_rate": m.get("cache_hit_rate"),
    }
    for stage in ("draft_s", "verify_s", "sample_s"):
        if m.get(stage) is not None:
            row[stage.replace("_s", "_ms")] = 1e3 * m[stage] / rounds
    return row


def measure_layout(case: Case, layout: str, methods=METHODS) -> list[dict]:
    """Every method at one layout in this process (``repeats`` times, methods interleaved), then one
    stage-profiled run each. Returns one row per run."""
    import jax

    from ssd_jax.parallel import distributed as dist

    target, draft = _models(case)
    counters = Counters()
    prompt = (
        [5, 6, 7, 8, 9, 10, 11, 12]
        if case.model == "tiny"
        else target.tokenizer.encode("def quicksort(arr):")
    )
    rows = []
    # the stage split: SD's stages on one device only (on two meshes a round is one call per side); AR has
    # no draft to place apart: measured on one device only
    plans = [
        (m, p)
        for m in methods
        for p in (False, True)
        if (m != "ar" or layout == "one") and (not p or m == "ssd" or (m == "sd" and layout == "one"))
    ]
    for method, profile in plans:  # compile every program first, at the full length (every window), untimed
        _one_run(
            target,
            _spec(method, draft, layout, case.k, profile),
            case,
            counters,
            prompt,
        )
    for r in range(case.repeats):
        for method, profile in plans:
            if profile and r:
                continue  # one profiled run per method: the stage split
            row = _one_run(target, _spec(method, draft, layout, case.k, profile), case, counters, prompt)
            row.update(method=method, layout=layout, profiled=profile, repeat=r, model=case.model, k=case.k)
            row.update(loadavg=os.getloadavg()[0], jax=jax.__version__)
            rows.append(row)
            if dist.is_main():
                print(
                    json.dumps(
                        {k: row[k] for k in ("layout", "method", "profiled", "round_ms", "calls_per_round")}
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def _ci(xs: list[float]) -> str:
    """Median and a 95% t-interval of the mean (``n < 2``: the value alone)."""
    import numpy as np

    if len(xs) < 2:
        return f"{xs[0]:.3f}" if xs else "-"
    from scipy import stats as sst

    m, s = float(np.mean(xs)), float(np.std(xs, ddof=1))
    h = sst.t.ppf(0.975, len(xs) - 1) * s / len(xs) ** 0.5
    return f"{float(np.median(xs)):.3f} [{m - h:.3f}, {m + h:.3f}]"


def report(rows: list[dict], title: str) -> str:
    """The markdown table: per layout and method, wall ms per round (median [95% interval of the mean]),
    the stages' ms per round when each runs as its own call and is waited for (``profile_stages``: a
    different, slower program than the fused round, shown for the split between stages, not as parts
    of the wall time), calls and syncs per round."""
    lines = [
        f"# Round cost: {title}",
        "",
        "| layout | method | wall ms / round | stages one by one, ms / round (draft or build, verify, sample) "
        "| calls / round | syncs / round | acceptance | hit rate | n |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        for method in METHODS:
            plain = [r for r in rows if r["layout"] == layout and r["method"] == method and not r["profiled"]]
            prof = [r for r in rows if r["layout"] == layout and r["method"] == method and r["profiled"]]
            if not plain:
                continue
            st = [prof[0].get(s, 0.0) for s in ("draft_ms", "verify_ms", "sample_ms")] if prof else None
            stages = "-" if st is None else ", ".join(f"{x:.3f}" for x in st)
            p = plain[-1]
            acc = "-" if p["acceptance_rate"] is None else f"{p['acceptance_rate']:.2f}"
            hit = "-" if p["cache_hit_rate"] is None else f"{p['cache_hit_rate']:.2f}"
            lines.append(
                f"| {layout} | {method} | {_ci([r['round_ms'] for r in plain])} | {stages} "
                f"| {p['calls_per_round']:.2f} | {p['syncs_per_round']:.2f} | {acc} | {hit} | {len(plain)} |"
            )
    load = [r["loadavg"] for r in rows]
    lines += [
        "",
        f"Load average (1 min) during the runs: {min(load):.2f}-{max(load):.2f}; jax {rows[0]['jax']}.",
    ]
    return "\n".join(lines) + "\n"


def _there_and_back(bridge, x, n: int) -> list[float]:
    import jax

    for _ in range(5):  # compile both directions
        y, _ = bridge.move(x, "draft")
        x, _ = bridge.move(y, "target")
    jax.block_until_ready(x)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        y, _ = bridge.move(x, "draft")
        x, _ = bridge.move(y, "target")
        jax.block_until_ready(x)
        out.append(time.perf_counter() - t)
    return out


def _socket_trips(n: int, payload: bytes) -> list[float]:
    """Round trips of ``payload`` over a plain TCP connection of their own between the two processes."""
    import socket

    from jax._src import distributed as jdist

    from ssd_jax.parallel import distributed as dist

    client = jdist.global_state.client
    if dist.is_main():
        srv = socket.create_server(("127.0.0.1", 0))
        client.key_value_set("roundcost/port", str(srv.getsockname()[1]))
        conn, _ = srv.accept()
    else:
        port = int(client.blocking_key_value_get("roundcost/port", 60_000))
        conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    trips = []
    for _ in range(n + 5):
        t = time.perf_counter()
        if dist.is_main():
            conn.sendall(payload)
            conn.recv(len(payload), socket.MSG_WAITALL)
        else:
            conn.sendall(conn.recv(len(payload), socket.MSG_WAITALL))
        trips.append(time.perf_counter() - t)
    conn.close()
    return trips[5:]


def measure_moves(n: int = 200, width: int = 8) -> dict | None:
    """Across two JAX processes (every process calls it): what one round's integer tensor (1 x ``width``
    int32, what an SSD round sends each way) costs to move there and back, by the compiled collective
    (the :class:`Bridge` without its link), by the bridge as the engine uses it (its :class:`Link` on
    CPU), and by a plain TCP round trip of the same bytes. Returns process 0's medians in ms (None
    elsewhere)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from ssd_jax.parallel import distributed as dist

    devs = jax.devices()
    meshes = [Mesh(np.array([d for d in devs if d.process_index == p][:1]), ("x",)) for p in (0, 1)]
    x = jax.device_put(np.arange(width, dtype=np.int32)[None], NamedSharding(meshes[0], PartitionSpec()))
    engine = dist.Bridge(*meshes)
    collective = dist.Bridge(*meshes)
    collective.linked = False
    times = {
        "collective_ms": _there_and_back(collective, x, n),
        "bridge_ms": _there_and_back(engine, x, n),
        "socket_ms": _socket_trips(n, np.arange(width, dtype=np.int32).tobytes()),
    }
    if not dist.is_main():
        return None
    return {
        **{k: 1e3 * float(np.median(v)) for k, v in times.items()},
        "n": n,
        "bridge_linked": getattr(engine, "linked", False),
    }
