"""What the loaders return: :class:`NumpyModel` (numpy weights) and :class:`LoadedModel` (on devices).

Kept apart from :mod:`ssd_jax.loading` so that the draft loader (:mod:`ssd_jax.loading.draft`)
builds a :class:`NumpyModel` without importing the package face that imports it.
"""

from __future__ import annotations

from typing import Any

import dataclasses

import numpy as np

from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import Params


@dataclasses.dataclass
class NumpyModel:
    """Weights as a flat dict of numpy arrays (memory-mapped when read from the cache)."""

    name: str
    cfg: ModelConfig
    flat: dict[str, np.ndarray]
    tokenizer: Tokenizer | None
    weights_sha256: str
    source: str


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: ``params`` is the nested pytree of device arrays (models.params)."""

    name: str
    cfg: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    weights_sha256: str
    source: str
    mesh: Any = None  # a jax.sharding.Mesh once placed on one (tensor parallel / SSD meshes); None = one device
