"""Sampling: the one temperature / top-k / top-p transform (:mod:`.filters`), exact rejection
sampling for speculative verification (:mod:`.rejection`) and Saguaro sampling for the SSD
draft (:mod:`.saguaro`).

The public sampling types are re-exported here (``from ssd_jax.sampling import SamplingParams``);
modules inside the package import from the submodules.
"""

from ssd_jax.sampling.filters import RowSampling, SamplingParams, filter_logprobs, sample

__all__ = ["RowSampling", "SamplingParams", "filter_logprobs", "sample"]
