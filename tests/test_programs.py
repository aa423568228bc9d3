"""The compiled-program factories' cache (:class:`ssd_jax.compile.ProgramCache`) and the XLA compile
counter (:class:`ssd_jax.compile.XlaCompiles`), without a model: what a warm engine asked for is never
evicted however many other programs are built, and is let go once the engine is gone."""

import gc

import jax
import jax.numpy as jnp

from ssd_jax.compile import ProgramCache, XlaCompiles, fresh_programs, program_factory, programs


class Holder:
    """Stands for an engine's method: the owner of the programs it warmed."""


def test_held_programs_survive_any_number_of_others():
    cache, built = ProgramCache(spare=4), []

    def build(key):
        built.append(key)
        return object()

    owner = Holder()
    with cache.held_by(owner):
        held = {k: cache.get(("held", k), lambda k=k: build(("held", k))) for k in range(10)}
    for k in range(100):  # many more than the spare places: offline runs, other engines
        cache.get(("other", k), lambda k=k: build(("other", k)))
    assert all(cache.get(("held", k), lambda: build("again")) is v for k, v in held.items())
    assert "again" not in built and cache.pinned == 10 and len(cache) == 10 + 4
    del owner
    gc.collect()
    cache.get(("other", 0), object)  # the owner's programs are let go at the next lookup
    assert cache.pinned == 0 and len(cache) == 4


def test_a_program_held_twice_stays_until_both_holders_are_gone():
    cache, a, b = ProgramCache(spare=0), Holder(), Holder()
    with cache.held_by(a):
        cache.get("shared", object)
    with cache.held_by(b):
        cache.get("shared", object)
    del a
    gc.collect()
    assert cache.get("other", object) and cache.pinned == 1 and len(cache) == 1
    del b
    gc.collect()
    cache.get("other2", object)
    assert cache.pinned == 0 and len(cache) == 0


def test_fresh_programs_build_apart_and_leave_nothing_behind():
    calls = []

    @program_factory
    def factory(x, *, y=0):
        calls.append((x, y))
        return object()

    first = factory(1)
    assert factory(1) is first and factory(1, y=2) is not first and len(calls) == 2
    with fresh_programs() as cache:
        inside = factory(1)
        assert inside is not first and programs() is cache and len(cache) == 1
    assert factory(1) is first and programs() is not cache


def test_xla_compiles_counts_after_the_mark_by_name():
    counter = XlaCompiles().start()
    try:

        def doubled(x):
            return x * 2

        f = jax.jit(doubled)
        f(jnp.ones(3, jnp.float32)).block_until_ready()
        assert counter.count >= 1 and counter.since_mark == 0
        counter.mark()
        f(jnp.ones(3, jnp.float32)).block_until_ready()  # compiled already: nothing
        assert counter.since_mark == 0
        f(jnp.ones(7, jnp.float32)).block_until_ready()  # a new shape compiles
        assert counter.since_mark >= 1 and any("doubled" in n for n in counter.after_mark)
    finally:
        counter.stop()
    n = counter.count
    jax.jit(doubled)(jnp.ones(11, jnp.float32)).block_until_ready()
    assert counter.count == n  # stopped: no longer listening


def test_drop_unheld_forgets_loose_programs_and_keeps_held_ones():
    from ssd_jax.compile import SPARE, ProgramCache

    class Holder:
        pass

    cache, h = ProgramCache(), Holder()
    assert cache.spare == SPARE <= 100  # ~300 mappings an entry: well under vm.max_map_count's 65,530
    with cache.held_by(h):
        cache.get("held", lambda: "program")
    for k in range(5):
        cache.get(k, lambda k=k: k)
    assert cache.drop_unheld() == 5 and len(cache) == 1 and cache.pinned == 1
    built = []
    assert cache.get("held", lambda: built.append(1)) == "program" and not built  # still there
