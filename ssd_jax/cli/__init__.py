"""Command-line front ends (the top layer): argument parsing and printing, nothing else.

``python -m ssd_jax.sdsl`` (:mod:`ssd_jax.cli.sdsl`), ``python -m ssd_jax.train``
(:mod:`ssd_jax.cli.train`), ``python -m ssd_jax.perfmodel`` / ``ssd_jax.perf``
(:mod:`ssd_jax.cli.perfmodel`), ``python -m ssd_jax.data`` (:mod:`ssd_jax.cli.data`) and
``python -m ssd_jax.bench`` (:mod:`ssd_jax.cli.bench`); the old module paths are two-line
shims that call these ``main`` functions. These modules may import anything in the package;
nothing in the package imports them (only the shims do). :mod:`ssd_jax.cli.args` holds the
argument parser they share.
"""
