"""The benchmark harness: per-method suites, resumable sweeps and their reports.

* :mod:`ssd_jax.bench.suites`: the ``ar``, ``sd`` and ``ssd`` suites (a results JSON and a
  markdown table each).
* :mod:`ssd_jax.bench.sweep`: resumable sweeps over a configuration grid, the oracle sweep,
  the built-in ``smoke`` and ``paper`` suites, reports with tables and plots.
* :mod:`ssd_jax.bench.protocol`: the benchmark protocol behind every speed claim (methods
  interleaved per prompt, repeats, resumable JSONL, ratios to AR with 95% intervals), with
  its statistics in :mod:`ssd_jax.bench.stats`.
* :mod:`ssd_jax.bench.perfsplit`: the performance model validated on a declared split of these
  results (protocol cells with their 95% intervals; ``python -m ssd_jax.perfmodel --validate-split``).
* :mod:`ssd_jax.bench.common`: what they share (environment record, draft loading).

The top of the package's layers: it may import anything below it (decoding, loading, data,
analysis); nothing imports it except the CLI (``python -m ssd_jax.bench``,
:mod:`ssd_jax.cli.bench`).
"""
