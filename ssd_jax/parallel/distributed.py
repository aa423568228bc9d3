"""Several JAX processes as one program (``jax.distributed``): start-up, and moving small arrays
between the disjoint target and draft meshes when they belong to different processes.

Every process runs the same Python program (SPMD, "multi-controller"): the same host loop, the
same jitted calls in the same order. A call on a mesh none of whose devices belong to this process
is a no-op here, so each process only computes on its own devices. What one side produces and the
other needs (the speculation, the verification outcome) crosses by JAX itself: :class:`Bridge`
stacks the source mesh's copy with zeros on the other devices into one array over the union of
both meshes and runs one jitted ``x[source]`` that XLA turns into a collective (gloo on CPU, NCCL /
ICI on accelerators). Its result is replicated on every device, so every process can also read it
on the host, which keeps the host loops of all processes deciding the same things. On CPU, where
that collective costs milliseconds for a few integers, a two-process run sends the source's host copy
over one TCP connection of its own instead (:func:`link`: bound to the address the processes were told
to use, authenticated both ways with the run's secret, typed frames only, :mod:`ssd_jax.parallel.link`;
``SSD_JAX_BRIDGE=collective`` keeps the collective).

Failure: a dead peer stops sending heartbeats; after ``SSD_JAX_HEARTBEAT_S`` seconds the coordination
service declares it dead. JAX's default reaction is to abort every other process with a C++ stack
trace, so recoverability is switched on (the survivors are only told) and a watchdog thread in
every process asks the service which processes are alive (``get_live_nodes``, once a second; it
returns when every live process has asked). When one is missing, the watchdog prints one line and
exits with status 1 (:func:`fail_fast`); an error raised in the main thread by a collective whose
peer vanished ends the same way (the CLI catches it).
"""

from __future__ import annotations

import logging
import atexit
import functools
import json
import os
import sys
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

#: seconds without a heartbeat before the coordinator declares a process dead (and the others exit);
#: 10 s proved too short on a loaded 2-core CI machine (compiles starve the heartbeat threads)
HEARTBEAT_S = 30
#: seconds every process waits for all the others at start-up
INIT_TIMEOUT_S = 60
#: seconds the shutdown barrier waits (a dead peer never reaches it)
SHUTDOWN_S = 30


def initialize() -> None:
    """``jax.distributed.initialize`` from the environment.

    ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0), ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID`` when set; otherwise JAX's cluster detection (TPU slice, SLURM, ...).
    On CPU, cross-process collectives use gloo. Timeouts (``SSD_JAX_HEARTBEAT_S``,
    ``SSD_JAX_INIT_TIMEOUT_S``) are short so that a dead peer stops the run within a minute.
    The coordination service (process 0) binds where the link does (:func:`~ssd_jax.parallel.link.
    bind_host`): loopback for a coordinator on this host, else the coordinator's address or
    ``SSD_JAX_LINK_HOST``; JAX's default is every interface.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only affects the CPU client
    kw: dict = {}
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        kw["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    if env.get("JAX_NUM_PROCESSES"):
        kw["num_processes"] = int(env["JAX_NUM_PROCESSES"])
    if env.get("JAX_PROCESS_ID"):
        kw["process_id"] = int(env["JAX_PROCESS_ID"])
    bind = _coordinator_bind(env.get("JAX_COORDINATOR_ADDRESS", ""))
    if bind is not None:
        kw["coordinator_bind_address"] = bind
    watch = _can_watch()
    if watch:  # a dead peer: tell us (the watchdog) instead of aborting us with a stack trace
        jax.config.update("jax_enable_recoverability", True)
    heartbeat = int(env.get("SSD_JAX_HEARTBEAT_S", HEARTBEAT_S))
    jax.distributed.initialize(
        **kw,
        initialization_timeout=int(env.get("SSD_JAX_INIT_TIMEOUT_S", INIT_TIMEOUT_S)),
        heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=int(env.get("SSD_JAX_SHUTDOWN_S", SHUTDOWN_S)),
    )
    if jax.process_count() > 1 and jax.process_index() > 0:  # (the backend exists now: it knows its node)
        from ssd_jax.compile import own_cache_folder

        own_cache_folder(jax.process_index())
    if watch and jax.process_count() > 1:
        from jax._src import distributed as jd

        global _CLIENT
        _CLIENT = jd.global_state.client
        atexit.register(_STOPPING.set)  # runs before JAX's own shutdown (registered earlier)
        threading.Thread(
            target=_watchdog,
            args=(_CLIENT, jax.process_count(), heartbeat),
            daemon=True,
            name="ssd-jax-peer-watchdog",
        ).start()


def _coordinator_bind(address: str) -> str | None:
    """``host:port`` for the coordination service to listen on (None: JAX's choice, every interface,
    left only where neither the coordinator's address nor ``SSD_JAX_LINK_HOST`` is known, or where the
    user set ``JAX_COORDINATOR_BIND_ADDRESS`` themselves)."""
    from ssd_jax.parallel.link import bind_host

    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or ":" not in address:
        return None
    host, port = address.rsplit(":", 1)
    bind = bind_host(host)
    if bind is None:
        return None
    return f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"


def _can_watch() -> bool:
    """Whether this JAX lets us ask the coordination service which processes are alive.

    ``get_live_nodes`` is not public API: without it we keep JAX's own abort on a dead peer."""
    try:
        from jax._src import distributed as jd
        from jax._src.lib import _jax
    except ImportError:
        return False
    return (
        "jax_enable_recoverability" in jax.config.values
        and hasattr(jd, "global_state")
        and hasattr(getattr(_jax, "DistributedRuntimeClient", None), "get_live_nodes")
    )


_STOPPING = threading.Event()  # normal exit: peers leaving is expected now
_CLIENT = None  # the runtime client the watchdog uses (None: no watchdog)


def _watchdog(client, n: int, heartbeat: int) -> None:
    ids = list(range(n))
    while not _STOPPING.is_set():
        try:
            live = client.get_live_nodes(ids)
        except Exception as e:  # noqa: BLE001 - the service itself is gone (process 0 died)
            if _STOPPING.is_set():
                return
            fail_fast(f"lost the coordination service (process 0 died?): {str(e).splitlines()[0][:200]}")
        missing = sorted(set(ids) - set(live))
        if missing:
            _STOPPING.wait(2.0)  # a peer that passed finish() may leave just before we set the flag
        if missing and not _STOPPING.is_set():
            fail_fast(
                f"process(es) {', '.join(map(str, missing))} stopped responding (no heartbeat for "
                f"{heartbeat} s); stopping"
            )
        time.sleep(1.0)


def multi_process() -> bool:
    return jax.process_count() > 1


def is_main() -> bool:
    """Process 0 prints results and writes files; the others only compute."""
    return jax.process_index() == 0


def fail_fast(message: str, status: int = 1) -> None:
    """One line on stderr, then exit without JAX's shutdown barrier (a dead peer never reaches it)."""
    sys.stderr.write(f"error: process {jax.process_index()}: {message}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(status)


def local_copy(x):
    """A host copy of a process-local array, so it can be placed on a mesh spanning processes.

    ``jax.device_put`` cannot move an array from this process's device to another process's
    devices (no cross-host transfers on CPU); from numpy each process places its own shards.
    """
    if multi_process() and isinstance(x, jax.Array) and x.is_fully_addressable:
        return np.asarray(x)
    return x


def host_value(x) -> np.ndarray:
    """The host copy of an array replicated over a mesh that has a device in this process."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_shards[0].data)


#: ``collective``: every move through the compiled collective, even where the :func:`link` could carry it
BRIDGE_ENV = "SSD_JAX_BRIDGE"


def _connect():
    """This process's :class:`~ssd_jax.parallel.link.Link` to the other, authenticated both ways.

    On CPU the collective's move of a round's few integers costs milliseconds (gloo; measured by
    ``python -m ssd_jax.roundcost``: 7.5 ms there and back against 0.03 ms over a socket), so
    :class:`Bridge` sends them over a TCP connection instead. Process 0 listens on a free port of the
    address the processes were told to use (loopback on one host; never every interface), publishes
    ``host:port`` in the coordination service's key-value store and accepts the first connection that
    answers its challenge with the run's secret (``SSD_JAX_LINK_SECRET``), dropping any other; process 1
    connects there and checks process 0 the same way. Both then agree on the package version and commit.
    Made once per process, at the first use, in the same order in both (every process runs the same
    program). A peer that closes the connection raises ``RuntimeError``; a peer that dies is caught by
    the watchdog (:func:`fail_fast`)."""
    import socket

    from jax._src import distributed as jd

    from ssd_jax.parallel.link import Link, accept_peer, answer, bind_host, identity, link_secret

    secret = link_secret()
    client = jd.global_state.client
    timeout = int(os.environ.get("SSD_JAX_INIT_TIMEOUT_S", INIT_TIMEOUT_S))
    me, peer = jax.process_index(), 1 - jax.process_index()
    if is_main():
        coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS") or jd.global_state.coordinator_address or ""
        host = bind_host(coordinator.rsplit(":", 1)[0] if ":" in coordinator else coordinator) or "127.0.0.1"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        srv = socket.create_server((host, 0), family=family)
        client.key_value_set("ssd_jax/link/address", f"{host}|{srv.getsockname()[1]}")
        try:
            conn, address = accept_peer(srv, secret, timeout)
        finally:
            srv.close()
    else:
        host, port = client.blocking_key_value_get("ssd_jax/link/address", timeout * 1000).split("|")
        address = f"{host}:{port}"
        conn = socket.create_connection((host, int(port)), timeout=timeout)
        answer(conn, secret, f"process 0 ({address})")
        conn.settimeout(None)
    link = Link(conn, me, peer, address)
    link.agree("the installation", identity(), optional=("commit",))
    log.info(f"[link] process {me} linked to process {peer} (TCP, authenticated)")
    return link


_LINK: list = []


def _plain(dtype) -> bool:
    """A dtype whose values are their bytes and that a move's header can name (not a PRNG key)."""
    from ssd_jax.parallel.link import dtype_code

    return dtype_code(dtype) is not None


def link():
    """This process's one :class:`~ssd_jax.parallel.link.Link` to the other (made on first use, in the
    same order in both: :func:`_connect`)."""
    if not _LINK:
        _LINK.append(_connect())
    return _LINK[0]


class Bridge:
    """Moves replicated pytrees between two disjoint meshes that may live in different processes.

    ``move(tree, to)`` takes arrays replicated on one mesh and returns ``(on_dst, readable)``:
    the same values replicated on the other mesh, and a copy readable by every process with
    :func:`host_value`. One compiled collective per call, whatever the tree (its result replicated on
    the union of both meshes); on CPU with each mesh in a process of its own, the source process's host
    copy sent over the :func:`link` instead (``readable`` is then that host copy, in both processes).
    """

    def __init__(self, target_mesh: Mesh, draft_mesh: Mesh):
        self.meshes = {"target": target_mesh, "draft": draft_mesh}
        devs = list(target_mesh.devices.flat) + list(draft_mesh.devices.flat)
        self.union = Mesh(np.asarray(devs), ("x",))
        self._stacked = NamedSharding(self.union, PartitionSpec("x"))
        self._first = {"target": 0, "draft": target_mesh.devices.size}
        self._local = [d for d in devs if d.process_index == jax.process_index()]
        self._zeros: dict = {}
        self.compiles = 0  # collectives compiled by this bridge's moves (0 once a run is warm)
        procs = {side: {d.process_index for d in m.devices.flat} for side, m in self.meshes.items()}
        self.linked = (
            os.environ.get(BRIDGE_ENV, "") != "collective"
            and jax.process_count() == 2
            and all(d.platform == "cpu" for d in devs)
            and all(len(p) == 1 for p in procs.values())
            and procs["target"] != procs["draft"]
        )
        self._proc = {side: next(iter(p)) for side, p in procs.items()}

    def _zero(self, shape, dtype, dev):
        key = (shape, str(dtype), dev.id)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = jax.device_put(np.zeros((1, *shape), dtype), dev)
        return z

    def _stack(self, x, src: str):
        src_ids = {d.id for d in self.meshes[src].devices.flat}
        mine = {s.device.id: s.data for s in x.addressable_shards}
        pieces = [
            mine[d.id][None] if d.id in src_ids else self._zero(x.shape, x.dtype, d) for d in self._local
        ]
        return jax.make_array_from_single_device_arrays(
            (len(self.union.devices.flat), *x.shape), self._stacked, pieces, dtype=x.dtype
        )

    def _move_linked(self, leaves, treedef, src: str, to: str):
        """The move over the :func:`link`: the source process reads its copy and sends it, the other
        receives it (checked against its own view of the same arrays' shapes and dtypes) and places it."""
        me, conn = jax.process_index(), link()
        if me == self._proc[src]:
            hosts = [np.asarray(x.addressable_shards[0].data) for x in leaves]
            conn.send_arrays(hosts)
        else:  # checked against this process's own view of the same arrays: dtype, shape, length
            hosts = conn.recv_arrays([(tuple(x.shape), x.dtype) for x in leaves])
        dst = NamedSharding(self.meshes[to], PartitionSpec())
        mine = [d for d in self.meshes[to].devices.flat if d.process_index == me]
        moved = [
            jax.make_array_from_single_device_arrays(
                x.shape, dst, [jax.device_put(h, d) for d in mine], dtype=x.dtype
            )
            for x, h in zip(leaves, hosts)
        ]
        return jax.tree.unflatten(treedef, moved), jax.tree.unflatten(treedef, hosts)

    def move(self, tree, to: str):
        src = "draft" if to == "target" else "target"
        leaves, treedef = jax.tree.flatten(tree)
        if self.linked and all(_plain(x.dtype) for x in leaves):
            return self._move_linked(leaves, treedef, src, to)
        stacked = [self._stack(x, src) for x in leaves]
        i = self._first[src]
        sig = (self.union, i, tuple((x.shape, str(x.dtype)) for x in leaves))
        if sig not in _SEEN_MOVES:  # the first call of this signature in this process compiles
            _SEEN_MOVES.add(sig)
            self.compiles += 1
        out = _pick_program(self.union, i)(stacked)
        dst = NamedSharding(self.meshes[to], PartitionSpec())
        dst_ids = {d.id for d in self.meshes[to].devices.flat}
        moved = [
            jax.make_array_from_single_device_arrays(
                x.shape, dst, [s.data for s in y.addressable_shards if s.device.id in dst_ids], dtype=x.dtype
            )
            for x, y in zip(leaves, out)
        ]
        return jax.tree.unflatten(treedef, moved), jax.tree.unflatten(treedef, out)


def _pick(xs, *, i: int):
    return [x[i] for x in xs]


_SEEN_MOVES: set = set()


@functools.lru_cache(maxsize=16)
def _pick_program(union: Mesh, i: int):
    """The move's collective, one jitted program per (union mesh, source), shared by every run's
    :class:`Bridge` so that a process compiles it once, not once per ``generate()``."""
    return jax.jit(functools.partial(_pick, i=i), out_shardings=NamedSharding(union, PartitionSpec()))


def gather_to_main(obj) -> list | None:
    """Every process's JSON-serialisable ``obj``, in process order, on process 0 (None elsewhere).

    Collective: every process must call it. Used once per run (the trace's events)."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    n = int(np.max(multihost_utils.process_allgather(np.int32(data.size))))
    buf = np.zeros(n, np.uint8)
    buf[: data.size] = data
    allb = np.asarray(multihost_utils.process_allgather(buf))
    if not is_main():
        return None
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in allb.reshape(jax.process_count(), n)]


def finish() -> None:
    """The end of a run: wait for every process, then peers leaving is no failure.

    With recoverability on, JAX's shutdown no longer waits for the others, so this barrier does, and
    process 0, which hosts the coordination service, leaves only after the others have disconnected
    (a process whose service vanished before it disconnected would abort)."""
    if not multi_process():
        _STOPPING.set()
        return
    sync_clock("ssd_jax_finish")
    _STOPPING.set()
    if _CLIENT is None:
        return
    if not is_main():
        jax.distributed.shutdown()
        return
    ids = list(range(jax.process_count()))
    deadline = time.monotonic() + SHUTDOWN_S
    while time.monotonic() < deadline:
        try:
            if len(_CLIENT.get_live_nodes(ids)) <= 1:
                return
        except Exception:  # noqa: BLE001 - nothing left to wait for
            return
        time.sleep(0.05)


_BARRIERS = [0]


def wait_for_peers(tag: str, timeout_s: float = 3600.0) -> None:
    """Block until every process reaches this point (the coordination service's barrier, with a long
    deadline). A gloo collective gives up when a peer is more than ~30 s late (its context's key
    exchange), so processes that did unequal work before it (a calibration, the hardware-fair
    protocol's AR and SD runs on process 0 alone) meet here first."""
    if not multi_process():
        return
    from jax._src import distributed

    _BARRIERS[0] += 1
    distributed.global_state.client.wait_at_barrier(f"ssd_jax/{tag}/{_BARRIERS[0]}", int(timeout_s * 1000))


def agree(value: int) -> int:
    """Process 0's integer, in every process (a decision each process made on its own, e.g. K)."""
    from jax.experimental import multihost_utils

    wait_for_peers("agree")  # each process measured for as long as it took
    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def sync_clock(name: str) -> None:
    """A barrier over every process (a common time origin for the trace)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
