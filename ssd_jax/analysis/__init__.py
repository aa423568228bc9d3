"""Analysis: models of decoding speed that run without decoding anything.

* :mod:`ssd_jax.analysis.sdsl`: the SDSL scaling law (the throughput-optimal draft size and
  lookahead), pure math over parameter counts.
* :mod:`ssd_jax.analysis.perfmodel`: the roofline performance model of AR, SD and SSD, its
  calibration and validation against benchmark results, and its predictions for GPUs.
* :mod:`ssd_jax.analysis.oracle`: offline acceptance analysis of greedy outputs (oracle
  bounds, n-gram vs draft by prompt-output overlap).

These modules depend on :mod:`ssd_jax.models` (configs, parameter counts, the forward pass)
and nothing above it; the command-line front ends live in :mod:`ssd_jax.cli`.
"""
