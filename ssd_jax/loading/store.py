"""Converted-weights cache: one ``.npy`` file per tensor plus a manifest.

A conversion is written into a hidden temporary sibling directory; the manifest is
written last and the directory is then renamed into place, so an interrupted run never
leaves an entry that :func:`load_converted` trusts. Tensors are loaded back memory-mapped.

Layout of an entry::

    manifest.json        format version, config, tensor names/shapes/dtypes, source sha256, meta
    tensors/<name>.npy   one per flat parameter name ("layers.3.wq.npy")
    tokenizer/           Tokenizer.save() output (optional)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ssd_jax.errors import UserError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import check_flat, param_specs

FORMAT_VERSION = 2  # 2: matrices stored (out, in)
MANIFEST = "manifest.json"
TENSOR_DIR = "tensors"
TOKENIZER_DIR = "tokenizer"

# dtypes numpy cannot describe in a .npy header are stored as raw bits of this dtype
_RAW_BITS = {"bfloat16": "uint16"}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def np_dtype(name: str) -> np.dtype:
    """numpy dtype for a dtype name, bfloat16 included (via ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def check_dtype(name: str) -> str:
    if name not in SUPPORTED_DTYPES:
        raise UserError(f"unsupported dtype {name!r} (supported: {', '.join(SUPPORTED_DTYPES)})")
    return name


def progress(iterable=None, **kw) -> tqdm:
    """tqdm on stderr; SSD_JAX_NO_PROGRESS=1 silences it."""
    kw.setdefault("file", sys.stderr)
    kw.setdefault("mininterval", 0.5)
    kw.setdefault("leave", False)
    kw.setdefault("disable", bool(os.environ.get("SSD_JAX_NO_PROGRESS")))
    return tqdm(iterable, **kw)


def is_converted_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _tmp_prefix(dest: Path) -> str:
    return f".{dest.name}.tmp-"


def _clean_stale_tmp(dest: Path) -> None:
    """Remove temp dirs left behind by conversions whose process no longer exists."""
    if not dest.parent.is_dir():
        return
    prefix = _tmp_prefix(dest)
    for p in dest.parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        try:
            pid = int(p.name[len(prefix) :].split("-")[0])
            os.kill(pid, 0)
            alive = True
        except (ValueError, ProcessLookupError):
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            shutil.rmtree(p, ignore_errors=True)


def save_converted(
    dest_dir: str | os.PathLike,
    cfg: ModelConfig,
    tensor_iter: Iterable[tuple[str, np.ndarray]],
    tokenizer=None,
    meta: dict[str, Any] | None = None,
    *,
    desc: str = "converting",
) -> Path:
    """Write a converted model atomically; returns ``dest_dir``.

    ``tensor_iter`` yields (flat name, array) one at a time; each array is cast to
    ``cfg.dtype``, written, and dropped before the next is requested. ``meta`` may carry
    ``source_sha256`` (stored at the top level of the manifest) and any other JSON data.
    If anything fails, the temporary directory is removed and nothing is left at
    ``dest_dir``. If ``dest_dir`` already holds an entry it is replaced.
    """
    dest = Path(dest_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(dest)
    tmp = dest.parent / f"{_tmp_prefix(dest)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    meta = dict(meta or {})
    dtype = check_dtype(cfg.dtype)
    target = np_dtype(dtype)
    specs = param_specs(cfg)
    try:
        (tmp / TENSOR_DIR).mkdir(parents=True)
        tensors: dict[str, dict[str, Any]] = {}
        bar = progress(total=len(specs), desc=desc, unit="tensor")
        for name, arr in tensor_iter:
            if name in tensors:
                raise ValueError(f"tensor {name} produced twice")
            if name not in specs:
                raise ValueError(f"unexpected tensor {name}")
            if tuple(arr.shape) != tuple(specs[name][0]):
                raise ValueError(f"tensor {name} has shape {tuple(arr.shape)}, expected {specs[name][0]}")
            arr = np.ascontiguousarray(arr, dtype=target)
            if dtype in _RAW_BITS:
                arr = arr.view(_RAW_BITS[dtype])
            fname = f"{name}.npy"
            np.save(tmp / TENSOR_DIR / fname, arr, allow_pickle=False)
            tensors[name] = {"file": fname, "shape": list(arr.shape), "dtype": dtype}
            del arr
            bar.update(1)
        bar.close()
        missing = sorted(set(specs) - set(tensors))
        if missing:
            raise ValueError(f"conversion produced no tensor for {missing[:5]}")
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_DIR)
            meta.setdefault("tokenizer_fingerprint", tokenizer.fingerprint())
        manifest = {
            "format_version": FORMAT_VERSION,
            "config": cfg.to_dict(),
            "dtype": dtype,
            "source_sha256": meta.get("source_sha256"),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "tensors": tensors,
            "has_tokenizer": tokenizer is not None,
            "meta": meta,
        }
        # the manifest is the last thing written: its presence marks a complete entry
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if dest.exists():
            old = dest.parent / f"{_tmp_prefix(dest)}{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _corrupt(path: Path, why: str) -> UserError:
    return UserError(f"converted model at {path} is unusable ({why}); delete the directory and convert again")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        raise _corrupt(path, f"no {MANIFEST}")
    try:
        with open(mf) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise _corrupt(path, f"unreadable {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise _corrupt(
            path,
            f"{MANIFEST} has format version "
            f"{manifest.get('format_version') if isinstance(manifest, dict) else None}, "
            f"expected {FORMAT_VERSION}",
        )
    return manifest


def load_converted(
    path: str | os.PathLike, dtype: str | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray], Any, dict[str, Any]]:
    """Open a converted entry: ``(cfg, {flat name: memory-mapped array}, Tokenizer | None, meta)``.

    Arrays are read-only memory maps in the stored dtype. If ``dtype`` is given and differs
    from the stored one, each array is cast (which materialises it in memory). Any
    missing, truncated or inconsistent file raises :class:`UserError`.
    """
    from ssd_jax.loading.tokenizer import Tokenizer

    path = Path(path)
    manifest = read_manifest(path)
    try:
        cfg = ModelConfig.from_dict(manifest["config"])
        tensors = manifest["tensors"]
        stored = manifest["dtype"]
        check_dtype(stored)
    except (KeyError, TypeError, ValueError, UserError) as e:
        raise _corrupt(path, f"bad {MANIFEST}: {e}") from None
    flat: dict[str, np.ndarray] = {}
    want = np_dtype(stored)
    for name, info in tensors.items():
        f = path / TENSOR_DIR / info["file"]
        try:
            arr = np.load(f, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise _corrupt(path, f"tensor {name}: {type(e).__name__}: {e}") from None
        if stored in _RAW_BITS:
            if arr.dtype != np.dtype(_RAW_BITS[stored]):
                raise _corrupt(path, f"tensor {name} stored as {arr.dtype}, expected raw {stored}")
            arr = arr.view(want)
        if list(arr.shape) != list(info["shape"]) or arr.dtype != want:
            raise _corrupt(
                path, f"tensor {name} is {arr.dtype}{list(arr.shape)}, manifest says {stored}{info['shape']}"
            )
        flat[name] = arr
    try:
        check_flat(cfg, flat)
    except ValueError as e:
        raise _corrupt(path, str(e)) from None
    if dtype is not None and check_dtype(dtype) != stored:
        target = np_dtype(dtype)
        flat = {k: np.asarray(v, dtype=target) for k, v in flat.items()}
    cfg = cfg.replace(dtype=dtype or stored)
    tok = None
    if manifest.get("has_tokenizer"):
        try:
            tok = Tokenizer.load(path / TOKENIZER_DIR)
        except UserError as e:
            raise _corrupt(path, f"tokenizer: {e}") from None
    meta = dict(manifest.get("meta") or {})
    meta.setdefault("source_sha256", manifest.get("source_sha256"))
    return cfg, flat, tok, meta


def iter_converted(flat: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """Pop (name, array) pairs so each memory map is released once the caller drops it."""
    for name in list(flat):
        yield name, flat.pop(name)
