"""Model loading: registry names, GGUF files, Hugging Face directories, converted caches,
trained drafts (``ssd_jax.loading.draft``).

``load_model(name_or_path, dtype)`` returns a :class:`LoadedModel` (config, parameter
pytree, tokenizer). GGUF sources (registered or by path) are converted once into
``<cache>/converted/<sha256[:16]>-<dtype>/`` and later loaded memory-mapped in seconds.
``load_numpy`` gives the same weights as numpy arrays for custom (e.g. sharded) placement.
"""

from __future__ import annotations

import logging
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.errors import UserError
from ssd_jax.loading import registry
from ssd_jax.loading.draft import SHIPPED_DRAFTS, is_draft_dir, open_draft, resolve_draft
from ssd_jax.loading.loaded import LoadedModel, NumpyModel
from ssd_jax.loading.registry import REGISTRY, cache_root, converted_path
from ssd_jax.loading.store import (
    check_dtype,
    is_converted_dir,
    iter_converted,
    load_converted,
    np_dtype,
    save_converted,
)
from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.models.forms import Forms
from ssd_jax.models.form_timing import resolve as resolve_forms
from ssd_jax.models.params import check_flat, to_layout, unflatten

log = logging.getLogger(__name__)

__all__ = [
    "LoadedModel",
    "NumpyModel",
    "Tokenizer",
    "cache_root",
    "load_model",
    "load_numpy",
    "registered_models",
]


def registered_models() -> list[str]:
    return registry.names()


def _warn(msg: str) -> None:
    log.warning(f"ssd_jax: {msg}")


def _unknown(name: str) -> UserError:
    return UserError(
        f"unknown model {name!r}: not a registered name ({', '.join(REGISTRY)}), a shipped draft "
        f"({', '.join(SHIPPED_DRAFTS)}) nor an existing path"
    )


# --- sha256 of GGUF files given by path, remembered by (path, size, mtime) ---------------
def _hash_index_path() -> Path:
    return cache_root() / "sha256-index.json"


def _file_sha256(path: Path) -> str:
    st = path.stat()
    key = str(path.resolve())
    stamp = [st.st_size, st.st_mtime_ns]
    index_file = _hash_index_path()
    try:
        with open(index_file) as f:
            index = json.load(f)
    except (OSError, ValueError):
        index = {}
    hit = index.get(key)
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    sha = registry.sha256_file(path, desc=f"hashing {path.name}")
    index[key] = {"stamp": stamp, "sha256": sha}
    try:
        index_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_file.with_name(f".{index_file.name}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=1)
        os.replace(tmp, index_file)
    except OSError:
        pass  # the index is only an optimisation
    return sha


def _convert_gguf(gguf_file: Path, sha: str, dtype: str, name: str) -> Path:
    from ssd_jax.loading.gguf_loader import read_gguf

    cfg, tensors, tok, warnings = read_gguf(gguf_file, dtype=dtype)
    for w in warnings:
        _warn(w)
    meta = {"source": "gguf", "source_sha256": sha, "source_path": str(gguf_file), "name": name}
    return save_converted(converted_path(sha, dtype), cfg, tensors, tok, meta, desc=f"converting {name}")


def _load_or_convert(sha: str, dtype: str, name: str, get_gguf: Callable[[], Path]) -> NumpyModel:
    """The converted entry for ``sha``; a missing or corrupt one is (re)built from the GGUF."""
    dest = converted_path(sha, dtype)
    if is_converted_dir(dest):
        try:
            return _from_converted(dest, dtype, name)
        except UserError as e:
            _warn(f"{e} (rebuilding it now)")
    _convert_gguf(get_gguf(), sha, dtype, name)
    return _from_converted(dest, dtype, name)


def _from_converted(path: Path, dtype: str, name: str | None = None) -> NumpyModel:
    """Memory-mapped arrays in their stored dtype (cast later, one tensor at a time)."""
    cfg, flat, tok, meta = load_converted(path)
    return NumpyModel(
        name=name or meta.get("name") or path.name,
        cfg=cfg.replace(dtype=dtype),
        flat=flat,
        tokenizer=tok,
        weights_sha256=meta.get("source_sha256") or "",
        source=str(meta.get("source_path") or path),
    )


def _cast(tensors: Iterator[tuple[str, np.ndarray]], dtype: str) -> Iterator[tuple[str, np.ndarray]]:
    target = np_dtype(dtype)
    for name, arr in tensors:
        yield name, (arr if arr.dtype == target else arr.astype(target))


def _open(name_or_path: str | os.PathLike, dtype: str) -> tuple[NumpyModel, Iterator[tuple[str, np.ndarray]]]:
    """Resolve a source: (model with an empty ``flat``, iterator of (name, array) in ``dtype``)."""
    dtype = check_dtype(dtype)
    key = str(name_or_path)
    if key in REGISTRY:
        entry = REGISTRY[key]
        m = _load_or_convert(entry.sha256, dtype, key, lambda: registry.fetch(key))
        return m, _cast(iter_converted(m.flat), dtype)
    p = Path(key).expanduser()
    if p.is_dir():
        if is_draft_dir(p):  # a draft trained by ssd_jax.train: shared tensors come from its target
            return open_draft(p, dtype, _open)
        if is_converted_dir(p):
            m = _from_converted(p, dtype)
            return m, _cast(iter_converted(m.flat), dtype)
        from ssd_jax.loading import hf_loader

        if hf_loader.is_hf_dir(p):
            cfg, tensors, tok = hf_loader.read_hf(p, dtype)
            m = NumpyModel(p.name, cfg, {}, tok, hf_loader.weights_sha256(p), str(p))
            return m, _cast(tensors, dtype)
        raise UserError(
            f"{p} is neither a Hugging Face model directory (config.json + *.safetensors), "
            f"a converted model (manifest.json) nor a trained draft (draft.json)"
        )
    if p.is_file():
        sha = _file_sha256(p)
        m = _load_or_convert(sha, dtype, p.stem, lambda: p)
        m.source = str(p)
        return m, _cast(iter_converted(m.flat), dtype)
    shipped = resolve_draft(key)  # a draft shipped in checkpoints/, by name
    if shipped is not None:
        return open_draft(shipped, dtype, _open)
    raise _unknown(key)


def _checked(m: NumpyModel, flat: dict[str, Any]) -> None:
    try:
        check_flat(m.cfg, flat)
    except ValueError as e:
        raise UserError(f"{m.source}: {e}") from None


def load_numpy(name_or_path: str | os.PathLike, dtype: str = "float32") -> NumpyModel:
    """Resolve ``name_or_path`` and return its weights as numpy arrays in ``dtype``.

    Accepts a registry name, a ``.gguf`` file, a Hugging Face directory or a converted
    cache directory. GGUF sources are converted into the cache on first use; arrays from
    the cache are read-only memory maps.
    """
    m, tensors = _open(name_or_path, dtype)
    flat = dict(tensors)
    _checked(m, flat)
    m.flat = flat
    return m


def _default_place(name: str, arr: np.ndarray) -> Any:
    import jax

    return jax.device_put(arr)


def load_model(
    name_or_path: str | os.PathLike,
    dtype: str = "float32",
    place: Callable[[str, np.ndarray], Any] | None = None,
    forms: str | Forms | None = None,
) -> LoadedModel:
    """Load a model and place its weights on devices, one tensor at a time.

    ``place(flat_name, array)`` returns the device array (default ``jax.device_put``; pass
    one that uses a ``NamedSharding`` for sharded placement). Arrays arrive in ``dtype``.
    On CPU, ``jax.device_put`` of a read-only memory map may alias the cache file instead
    of copying it, so loading from the cache is fast and uses page cache, not heap.

    ``forms`` (``ssd_jax.models.forms.resolve``: "auto" by default, per backend) sets the
    returned ``cfg.forms``; a matrix whose layout differs from the stored one is transposed
    once, here, before ``place`` sees it (arrays then arrive in that layout: build shardings
    from the returned config's ``param_specs``).
    """
    m, tensors = _open(name_or_path, dtype)
    cfg = m.cfg.replace(forms=resolve_forms(m.cfg, forms))
    place = place or _default_place
    placed: dict[str, Any] = {}
    for name, arr in tensors:  # one at a time, already in dtype; our reference is dropped once placed
        arr = to_layout(m.cfg, cfg, name, arr)
        placed[name] = place(name, arr)
        del arr
    m.cfg = cfg
    _checked(m, placed)
    model = LoadedModel(
        name=m.name,
        cfg=cfg,
        params=unflatten(cfg, placed),
        tokenizer=m.tokenizer,
        weights_sha256=m.weights_sha256,
        source=m.source,
    )
    return model
