"""Ahead-of-time compiled device programs with static shapes.

:class:`Compiled` lowers and compiles a jitted function explicitly the first time a new set of
argument shapes is seen, records how long that took (reported as ``compile_s``), and afterwards
calls the executable directly, so that a generation loop can never recompile behind the user's
back. Every device step of the project (model steps, drafters, SD / SSD rounds) is one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax


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
