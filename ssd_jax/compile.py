"""Ahead-of-time compiled device programs with static shapes.

:class:`Compiled` lowers and compiles a jitted function explicitly the first time a new set of
argument shapes is seen, records how long that took (reported as ``compile_s``), and afterwards
calls the executable directly, so that a generation loop can never recompile behind the user's
back. Every device step of the project (model steps, drafters, SD / SSD rounds) is one.

:func:`program_factory` memoizes the functions that build them (one :class:`Compiled` per key) in
a :class:`ProgramCache`, where every program an engine asked for while warming up stays for as long
as the engine does; :class:`XlaCompiles` counts what XLA compiles, so that a server can show (and a
test assert) that it compiled nothing once it was warm.

:func:`use_persistent_cache` turns on JAX's persistent compilation cache for a run (every CLI and
the server call it through :func:`ssd_jax.errors.cli_main`), so that a second run loads its
programs instead of compiling them again.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import logging
import os
import platform
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger(__name__)


def _leaf_key(x):
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, x.sharding)
    if hasattr(x, "shape"):
        return (tuple(x.shape), str(x.dtype))
    return (type(x), x)


class Compiled:
    """A jitted function compiled ahead of time once per argument signature."""

    def __init__(self, fn: Callable, *, donate_argnums: tuple[int, ...] = (), name: str = ""):
        self.name = name or getattr(fn, "__name__", "fn")
        self._jit = jax.jit(fn, donate_argnums=donate_argnums)
        self._exe: dict[Any, Any] = {}
        self._last = None  # the executable of the previous call: the loops call with one signature
        self.compile_s = 0.0
        self.compiles = 0

    #: seconds spent compiling by every Compiled of this process (a run's compile time is its change)
    total_s = 0.0

    def _key(self, args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        return tree, tuple(_leaf_key(x) for x in leaves)

    def precompile(self, *args) -> float:
        """Compile for ``args``' signature if needed; returns the seconds spent compiling."""
        key = self._key(args)
        if key in self._exe:
            return 0.0
        t = time.perf_counter()
        self._exe[key] = self._jit.lower(*args).compile()
        dt = time.perf_counter() - t
        self.compile_s += dt
        self.compiles += 1
        Compiled.total_s += dt
        return dt

    def __call__(self, *args):
        # Fast path: the previous call's executable. It checks the arguments' structure, shapes,
        # dtypes and shardings itself before running (TypeError / ValueError on a mismatch, before
        # any buffer is donated), which is far cheaper than hashing every leaf's signature here
        # (about 1 ms per call for a 30-layer parameter tree). A genuine error re-raises below.
        if self._last is not None:
            try:
                return self._last(*args)
            except (TypeError, ValueError):
                pass
        key = self._key(args)
        exe = self._exe.get(key)
        if exe is None:
            self.precompile(*args)
            exe = self._exe[key]
        self._last = exe
        return exe(*args)


#: programs kept beyond those a live engine holds (:class:`ProgramCache`)
SPARE = 64


class ProgramCache:
    """The memo of the compiled-program factories (:func:`program_factory`): one :class:`Compiled` per
    factory and arguments, so that every engine of a process shares a program once it is compiled.

    The keys a server can call are bounded by its configuration (windows x batch buckets x modes x
    Ks x kinds), and an engine warms every one of them; a least-recently-used bound of a fixed size
    evicted some of those on large configurations (``--context-buckets 6 --batch-buckets 7``: 84 AR
    rounds against 64 places), and a warm server then compiled them again while it served. So the
    programs asked for inside :meth:`held_by` are pinned until their holder (an engine's method) is
    garbage: nothing a warm engine calls is evicted, whatever its configuration. The other programs
    (offline runs, calibrations, engines gone) are kept up to ``spare``, least recently used first: each
    holds compiled code and XLA:CPU maps every executable separately, so a process building many
    engines (a test run) must not keep them all: an entry of the tiny test models holds about 300
    memory mappings, and Linux allows a process 65,530 (``vm.max_map_count``); 256 spare entries took
    the test suite's workers past it (XLA aborted in a compile or a cache read). :data:`SPARE` keeps
    them at about 20,000, room for a benchmark's interleaved methods; :meth:`drop_unheld` empties the
    rest at will (the test suite does after each module)."""

    def __init__(self, spare: int | None = None):
        spare = SPARE if spare is None else spare
        self.spare = spare
        self._entries: dict = {}
        self._loose: collections.OrderedDict = collections.OrderedDict()  # unpinned keys, oldest first
        self._pins: collections.Counter = collections.Counter()
        self._holders: list[set] = []  # the key sets of the open held_by blocks
        self._released: collections.deque = collections.deque()  # key sets of holders gone (finalizers)
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pinned(self) -> int:
        """Programs some live holder asked for while warming up."""
        return len(self._pins)

    def get(self, key, build: Callable):
        """The program under ``key``, built by ``build()`` the first time."""
        with self._lock:
            self._settle()
            value = self._entries.get(key)
            if value is None:
                value = self._entries[key] = build()
            for held in self._holders:
                if key not in held:
                    held.add(key)
                    self._pins[key] += 1
            if self._pins.get(key):
                self._loose.pop(key, None)
            else:
                self._loose[key] = None
                self._loose.move_to_end(key)
                self._evict()
            return value

    @contextlib.contextmanager
    def held_by(self, owner):
        """Pin every program asked for in the block until ``owner`` is garbage."""
        held: set = set()
        with self._lock:
            self._holders.append(held)
        try:
            yield held
        finally:
            with self._lock:
                self._holders.remove(held)
            # a finalizer may run inside any allocation, this cache's own included: it only queues
            weakref.finalize(owner, self._released.append, held)

    def _settle(self) -> None:
        while self._released:
            for key in self._released.popleft():
                self._pins[key] -= 1
                if self._pins[key] <= 0:
                    del self._pins[key]
                    if key in self._entries:
                        self._loose[key] = None
        self._evict()

    def drop_unheld(self) -> int:
        """Forget every program no live holder pinned (they compile again, or load from the persistent
        cache, when asked for); returns how many were dropped."""
        with self._lock:
            self._settle()
            n = len(self._loose)
            for key in self._loose:
                self._entries.pop(key, None)
            self._loose.clear()
            return n

    def _evict(self) -> None:
        while len(self._loose) > self.spare:
            key, _ = self._loose.popitem(last=False)
            self._entries.pop(key, None)


_programs: list[ProgramCache] = [ProgramCache()]  # the process's cache; fresh_programs() stacks others


def programs() -> ProgramCache:
    """The program cache the factories use now."""
    return _programs[-1]


@contextlib.contextmanager
def fresh_programs():
    """Every factory builds into a new, empty :class:`ProgramCache` inside the block, dropped at its end:
    a test that patches a traced function gets programs of its own and leaves none behind."""
    cache = ProgramCache()
    _programs.append(cache)
    try:
        yield cache
    finally:
        _programs.remove(cache)


def program_factory(fn: Callable) -> Callable:
    """``fn(*args)`` -> a compiled program (or a tuple / dict of them), memoized in :func:`programs` by
    its arguments (hashable: configs are frozen dataclasses). Replaces ``functools.lru_cache``, whose
    fixed bound evicted programs a warm server still called."""

    @functools.wraps(fn)
    def get(*args, **kwargs):
        key = (get, args, tuple(sorted(kwargs.items())))
        return programs().get(key, lambda: fn(*args, **kwargs))

    return get


class XlaCompiles:
    """XLA compilations in this process, counted through ``jax.monitoring``'s backend-compile event
    (one per program JAX hands to XLA, a load from the persistent compilation cache included: both
    stall the caller), split at :meth:`mark` (a server marks the end of its warm-up) into before and
    after. Each compilation after the mark is logged with its program's name: a warm server should
    compile nothing.

    :meth:`start` registers the listener (a process's counting starts there); :meth:`stop` removes it."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = self.count_at_mark = 0
        self.seconds = self.seconds_at_mark = 0.0
        self.marked = False
        self.after_mark: list[str] = []  # the programs compiled after the mark, by name
        self._lock = threading.Lock()
        self._listening = False

    def start(self) -> XlaCompiles:
        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            self._listening = True
        return self

    def stop(self) -> None:
        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._on_event)
            self._listening = False

    def mark(self) -> None:
        with self._lock:
            self.count_at_mark, self.seconds_at_mark, self.marked = self.count, self.seconds, True
            self.after_mark = []

    @property
    def since_mark(self) -> int:
        return self.count - self.count_at_mark if self.marked else 0

    def _on_event(self, event: str, duration: float, **kw) -> None:
        if event != self.EVENT:
            return
        name = str(kw.get("fun_name", "?"))
        with self._lock:
            self.count += 1
            self.seconds += duration
            if self.marked:
                self.after_mark.append(name)
        if self.marked:
            log.warning("compiled %s after warm-up (%.2f s)", name, duration)


#: the process's count, started by the server (:mod:`ssd_jax.serve`); tests may make their own
XLA_COMPILES = XlaCompiles()


#: ``0`` (or off / false / no): no persistent compilation cache; a path: the cache under that folder
CACHE_ENV = "SSD_JAX_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no")


def cpu_tag() -> str:
    """The host CPU's model name and ISA flags, read from ``/proc/cpuinfo`` (the machine name elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))


def user_cache() -> Path:
    """The user cache folder (``$SSD_JAX_CACHE`` or ``~/.cache/ssd_jax``), as
    :func:`ssd_jax.loading.registry.cache_root` has it, for the layers below loading."""
    return Path(os.environ.get("SSD_JAX_CACHE") or Path.home() / ".cache" / "ssd_jax").expanduser()


def persistent_cache_dir() -> Path | None:
    """Where :func:`use_persistent_cache` puts the cache: ``None`` when ``SSD_JAX_COMPILE_CACHE`` is
    off, else ``<folder>/jax-<version>-<hash of this CPU's model and flags>``, the folder being
    ``$SSD_JAX_COMPILE_CACHE`` or ``<user cache>/jit`` (the user cache as in
    :func:`ssd_jax.loading.registry.cache_root`: ``$SSD_JAX_CACHE`` or ``~/.cache/ssd_jax``).

    JAX's own key (``jax/_src/cache_key.py``) hashes the program, the jaxlib version, the backend's
    platform and version, ``XLA_FLAGS``, the compile options and the devices' topology; on CPU the
    platform version is just ``cpu``, so nothing in it names the host's CPU model or ISA, while
    XLA:CPU compiles for the host's instruction set. Hence the CPU subfolder: a home folder shared by
    two machines never hands one of them the other's code. The jax version is in the name too.
    """
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() in _OFF:
        return None
    import jaxlib

    if value:
        base = Path(value).expanduser()
    else:
        base = user_cache() / "jit"
    ident = f"{jax.__version__}\0{jaxlib.__version__}\0{platform.machine()}\0{cpu_tag()}"
    return base / f"jax-{jax.__version__}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def use_persistent_cache() -> str | None:
    """Turn on JAX's persistent compilation cache for this process, caching every program; returns
    its folder, or ``None`` when it is off. Call it before the first compilation (JAX decides once,
    at its first compile, whether a cache is used).

    ``SSD_JAX_COMPILE_CACHE=0`` turns it off (even one that ``JAX_COMPILATION_CACHE_DIR`` asks for);
    a folder that ``JAX_COMPILATION_CACHE_DIR`` (or ``jax.config``) already names is kept as it is;
    otherwise :func:`persistent_cache_dir`. The minimum compile time and entry size that JAX caches
    become 0 unless their ``JAX_PERSISTENT_CACHE_MIN_*`` variables are set.
    """
    if os.environ.get(CACHE_ENV, "").strip().lower() in _OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = jax.config.jax_compilation_cache_dir
    if not path:
        path = str(persistent_cache_dir())
        jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no minimum, no override
    return path


def own_cache_folder(process_index: int) -> str | None:
    """Process ``process_index`` > 0 of a ``jax.distributed`` run: a persistent-cache folder of its own,
    which it writes. JAX writes cache entries from process 0 only (``jax/_src/compiler.py``, to keep
    processes from contending for one folder's files), so the programs only another process compiles
    (SSD's draft side, on process 1 under the launcher) were compiled again at every start: a launched
    SSD server took 102 s to start where one process took 25 s. A folder per process removes the
    contention; the writer check reads ``distributed.global_state.process_id``, which JAX otherwise uses
    only when it creates the backend (done by now) and to share binaries of programs spanning
    processes (off by default). Returns the folder (None: the cache is off)."""
    path = jax.config.jax_compilation_cache_dir
    if not path or os.environ.get(CACHE_ENV, "").strip().lower() in _OFF:
        return None
    from jax._src import distributed as jd

    own = os.path.join(path, f"process-{process_index}")
    jax.config.update("jax_compilation_cache_dir", own)
    jd.global_state.process_id = 0  # this process writes its own folder
    return own
