"""What the loaders return: :class:`NumpyModel` (numpy weights) and :class:`LoadedModel` (on devices).

Kept apart from :mod:`ssd_jax.loading` so that the draft loader (:mod:`ssd_jax.loading.draft`)
builds a :class:`NumpyModel` without importing the package face that imports it.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import dataclasses
import weakref

import numpy as np

from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import Params, cast_matrices


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
    mesh: Any = (
        None  # a jax.sharding.Mesh once placed on one (tensor parallel / SSD meshes); None = one device
    )


#: (id(model), tag) -> (a weak reference to model, a model derived from it); an entry goes when
#: its model does, so a draft reused across ``generate`` calls is cast / trimmed once
_DERIVED: dict[tuple[int, str], tuple[weakref.ref, Any]] = {}


def derived(model: Any, tag: str, make: Callable[[], Any]) -> Any:
    """``make()``, computed once per live ``model`` and ``tag`` (the result must not refer to
    ``model`` itself, or the entry would keep it alive)."""
    key = (id(model), tag)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]
    out = make()
    # the callback holds the dict itself: at interpreter exit the module's globals may be gone
    _DERIVED[key] = (weakref.ref(model, lambda _, k=key, d=_DERIVED: d.pop(k, None)), out)
    return out


def forget_derived(model: Any, tag: str) -> None:
    """Drop what :func:`derived` keeps for ``model`` and ``tag`` (a variant measured, not chosen)."""
    _DERIVED.pop((id(model), tag), None)


def with_weight_dtype(model: LoadedModel, dtype: str) -> LoadedModel:
    """``model`` with its weight matrices stored in ``dtype`` while it still computes in
    ``cfg.dtype`` (``ModelConfig.weight_dtype``; ``--draft-dtype``). Norms, biases and the KV
    cache keep ``cfg.dtype``. Returns ``model`` itself when nothing changes; otherwise a copy,
    cached while ``model`` lives."""
    import jax.numpy as jnp

    want = None if dtype == model.cfg.dtype else dtype
    if model.cfg.weight_dtype == want:
        return model
    return derived(
        model,
        f"dtype:{dtype}",
        lambda: dataclasses.replace(
            model,
            cfg=model.cfg.replace(weight_dtype=want),
            params=cast_matrices(model.cfg, model.params, jnp.dtype(dtype)),
        ),
    )
