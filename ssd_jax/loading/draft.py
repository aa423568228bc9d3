"""Trained drafts (``python -m ssd_jax.train``): the on-disk layout and loading.

A draft trained for a target shares the target's tokenizer and its embedding table (and
the output head when the target's is untied). Those shared tensors are NOT stored with
the draft: the checkpoint keeps only what training changed (the decoder layers and the
final norm), and loading re-attaches the shared tensors from the target named in the
metadata after checking that it is the same target (sha256 of the target's weights, and
of the shared tensors' float32 bytes when loading in float32).

Layout of a training directory ``checkpoints/<name>/``::

    draft.json          metadata: target (name, path, weights sha256), shared tensors and
                        their sha256, config, parameter counts, training arguments, data,
                        step, evaluation history, best evaluation
    train_log.jsonl     one line per training step (loss, lr, ...), cut back on resume
    state/<step>/       orbax CheckpointManager steps: {"params", "opt_state"}, last few kept
    best/               the best step by eval acceptance, exported on its own:
      draft.json          the metadata of that step
      params/             orbax params-only checkpoint (trained tensors only)

Shipped drafts load by name from any working directory (``--draft smollm2-135m-draft``): a
name that is not a path is looked up as ``<root>/<name>/draft.json`` in ``$SSD_JAX_CHECKPOINTS``
(if set), then in the ``checkpoints/`` folder beside the ``ssd_jax/`` package (the repository
root of a source checkout or an editable install). A non-editable install has no such folder:
a shipped name then fails with a one-line error that says where to point
``SSD_JAX_CHECKPOINTS``.

``best/`` alone is a complete draft (ship it under 50 MB). A directory loads as a draft
when it holds ``draft.json``: from ``params/`` if present, else from ``best/``, else from
the newest complete step of ``state/`` (older steps are tried if the newest is damaged).
Anything missing or unreadable is a one-line :class:`UserError`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.errors import UserError
from ssd_jax.loading.loaded import NumpyModel
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import flatten, param_specs

DRAFT_META = "draft.json"
FORMAT = "ssd_jax.draft"
FORMAT_VERSION = 1
PARAMS_DIR = "params"
STATE_DIR = "state"
BEST_DIR = "best"

# the tensors a draft can take from its target instead of storing them
SHAREABLE = ("embed", "lm_head")

#: drafts that ship in the repository's ``checkpoints/`` folder (named in errors when absent)
SHIPPED_DRAFTS = ("smollm2-135m-draft",)
#: EAGLE-style heads that ship there (``checkpoints/<name>/head.safetensors``; ssd_jax.drafters.eagle)
SHIPPED_HEADS = ("smollm2-135m-eagle", "qwen2.5-coder-1.5b-eagle")
CHECKPOINTS_ENV = "SSD_JAX_CHECKPOINTS"


def checkpoint_roots() -> list[Path]:
    """Folders searched for drafts given by name: ``$SSD_JAX_CHECKPOINTS``, then the repository's
    ``checkpoints/`` (beside the ``ssd_jax`` package)."""
    roots = []
    env = os.environ.get(CHECKPOINTS_ENV)
    if env:
        roots.append(Path(env).expanduser())
    roots.append(Path(__file__).resolve().parents[2] / "checkpoints")
    return roots


def resolve_draft(name_or_path: str | os.PathLike) -> Path | None:
    """The directory of a trained draft given by path or by shipped name; None if it is neither.

    An existing path wins over a name. A name of :data:`SHIPPED_DRAFTS` that is found in no root
    is a :class:`UserError` (a non-editable install does not carry ``checkpoints/``).
    """
    key = str(name_or_path)
    p = Path(key).expanduser()
    if is_draft_dir(p):
        return p
    if p.exists() or not key or "/" in key or os.sep in key or key.startswith("."):
        return None
    roots = checkpoint_roots()
    for root in roots:
        if is_draft_dir(root / key):
            return root / key
    if key in SHIPPED_DRAFTS:
        raise UserError(
            f"shipped draft {key!r} not found (looked in {', '.join(str(r) for r in roots)}): it lives in the "
            f"repository's checkpoints/ folder, which a non-editable install lacks; use an editable install "
            f"(pip install -e REPO) or set {CHECKPOINTS_ENV}=REPO/checkpoints"
        )
    return None


def resolve_head(name: str) -> Path | None:
    """The directory of an EAGLE-style head given by shipped name (``<root>/<name>/head.safetensors`` in
    :func:`checkpoint_roots`), or None. A name of :data:`SHIPPED_HEADS` found in no root is a
    :class:`UserError`, as for shipped drafts."""
    roots = checkpoint_roots()
    for root in roots:
        if (root / name / "head.safetensors").is_file():
            return root / name
    if name in SHIPPED_HEADS:
        raise UserError(
            f"shipped head {name!r} not found (looked in {', '.join(str(r) for r in roots)}): it lives in the "
            f"repository's checkpoints/ folder, which a non-editable install lacks; use an editable install "
            f"(pip install -e REPO) or set {CHECKPOINTS_ENV}=REPO/checkpoints"
        )
    return None


def trained_head_vocab(source: str | os.PathLike) -> tuple[int, Path] | None:
    """``(N, draft directory)`` when the model loaded from ``source`` (a :class:`LoadedModel`'s
    ``source``: a draft's ``params/`` or ``state/<step>``) is a draft trained with ``--draft-vocab N``:
    it decodes with that trimmed head by default (:func:`ssd_jax.drafters.vocab.trim_draft`, the
    kept ids from the ``token_counts.npz`` it was trained with). None otherwise."""
    p = Path(str(source))
    for d in (p, *list(p.parents)[:3]):
        if is_draft_dir(d):
            try:
                with open(d / DRAFT_META) as fh:
                    n = json.load(fh).get("train", {}).get("args", {}).get("draft_vocab")
            except (OSError, ValueError, AttributeError):
                return None
            return (int(n), d) if n else None
    return None


def is_draft_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / DRAFT_META).is_file()


def _bad(path: Path, why: str) -> UserError:
    return UserError(f"draft checkpoint {path} is unusable ({why})")


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``draft.json`` of a draft directory, checked for the fields loading needs."""
    path = Path(path)
    f = path / DRAFT_META
    if not f.is_file():
        raise UserError(f"no draft checkpoint at {path} (missing {DRAFT_META})")
    try:
        with open(f) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        raise _bad(path, f"unreadable {DRAFT_META}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(path, f"{DRAFT_META} is not a {FORMAT} file")
    if meta.get("format_version") != FORMAT_VERSION:
        raise _bad(path, f"format version {meta.get('format_version')}, expected {FORMAT_VERSION}")
    for key in ("config", "target", "shared"):
        if not isinstance(meta.get(key), dict):
            raise _bad(path, f"{DRAFT_META} has no {key!r} section")
    return meta


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON through a temporary file and a rename: readers see the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def draft_config(meta: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_dict(meta["config"])


def trained_names(cfg: ModelConfig, shared: list[str]) -> list[str]:
    """Flat names of the tensors a draft stores (everything its config declares but the shared ones)."""
    return [n for n in param_specs(cfg) if n not in shared]


def shared_sha256(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over the float32 bytes of the shared tensors, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name], dtype=np.float32)
        h.update(f"{name}:{a.shape}\n".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


# --- finding the stored parameters ----------------------------------------------------------
def complete_steps(state_dir: str | os.PathLike) -> list[int]:
    """Steps of an orbax CheckpointManager directory that were finalised, newest first.

    Orbax writes a step into a temporary directory and renames it to ``<step>`` when done,
    so a save killed half way leaves only a ``<step>.orbax-checkpoint-tmp-*`` directory,
    which is not listed here.
    """
    d = Path(state_dir)
    if not d.is_dir():
        return []
    steps = []
    for p in d.iterdir():
        if p.is_dir() and p.name.isdigit() and (p / "_CHECKPOINT_METADATA").is_file():
            steps.append(int(p.name))
    return sorted(steps, reverse=True)


def quiet_orbax() -> None:
    """Keep absl and orbax from logging below ERROR (checkpoint saves and restores are chatty)."""
    import logging

    for name in ("absl", "orbax"):
        logging.getLogger(name).setLevel(logging.ERROR)


def restore_params(item_dir: str | os.PathLike, abstract: dict[str, Any]) -> dict[str, Any]:
    """Restore an orbax pytree checkpoint as host numpy arrays in the structure, shapes and dtypes of
    ``abstract`` (a pytree of ``jax.ShapeDtypeStruct``s or arrays), in this process alone.

    Under ``jax.distributed`` every process loads the draft (SPMD) but any of them may hold the draft's
    devices, so the restore involves no device and no other process: no sharding (a jax.Array restore
    onto a device of another process has no addressable shard and fails), and orbax's barriers limited
    to this process (``active_processes``; by default orbax ends every restore with a collective over
    all processes' devices, which waits forever for a peer that failed or restores at another time).
    The arrays are placed afterwards like any loaded model's. The values are the stored ones,
    bit for bit (read by tensorstore, cast to ``abstract``'s dtype as a device restore would).
    """
    import jax
    import orbax.checkpoint as ocp

    quiet_orbax()
    me = jax.process_index()
    mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    item = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape), np.dtype(a.dtype)), abstract)
    restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), item)
    ckptr = ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(multiprocessing_options=mp), multiprocessing_options=mp
    )
    try:
        out = ckptr.restore(
            Path(item_dir).absolute(), args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
        )
    finally:
        ckptr.close()
    if jax.tree.structure(out) != jax.tree.structure(item):
        raise ValueError(f"stored tree {jax.tree.structure(out)}, expected {jax.tree.structure(item)}")
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(item), jax.tree.leaves(out)):
        if not isinstance(g, np.ndarray) or g.shape != w.shape or g.dtype != w.dtype:
            desc = f"{type(g).__name__} {getattr(g, 'shape', '?')} {getattr(g, 'dtype', '?')}"
            raise ValueError(f"{jax.tree_util.keystr(path)}: stored {desc}, expected {w.shape} {w.dtype}")
    return out


def _abstract_trained(cfg: ModelConfig, shared: list[str]) -> dict[str, Any]:
    """ShapeDtypeStructs (float32, no device: restored to the host) of the trained tensors as the
    nested pytree."""
    import jax

    specs = param_specs(cfg)
    flat = {n: jax.ShapeDtypeStruct(specs[n][0], np.float32) for n in trained_names(cfg, shared)}
    return nest_trained(cfg, flat)


def nest_trained(cfg: ModelConfig, flat: dict[str, Any]) -> dict[str, Any]:
    """Flat trained tensors -> the nested pytree training uses: {"layers": [...], "final_norm", ...}."""
    out: dict[str, Any] = {k: v for k, v in flat.items() if not k.startswith("layers.")}
    layers: list[dict[str, Any]] = [{} for _ in range(cfg.num_layers)]
    for k, v in flat.items():
        if k.startswith("layers."):
            _, i, name = k.split(".", 2)
            layers[int(i)][name] = v
    out["layers"] = layers
    return out


def _restore_trained(path: Path, cfg: ModelConfig, shared: list[str]) -> tuple[dict[str, Any], str]:
    """(trained tensors as a nested pytree, where they came from) for a draft directory."""
    abstract = _abstract_trained(cfg, shared)
    if (path / PARAMS_DIR).is_dir():
        try:
            return restore_params(path / PARAMS_DIR, abstract), str(path / PARAMS_DIR)
        except Exception as e:  # orbax raises many types for damaged files
            raise _bad(
                path, f"cannot restore {PARAMS_DIR}/: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            ) from None
    steps = complete_steps(path / STATE_DIR)
    if not steps:
        raise _bad(path, f"no {PARAMS_DIR}/, no {BEST_DIR}/ and no complete step in {STATE_DIR}/")
    errors = []
    for s in steps:  # newest first; a damaged step falls back to the one before
        try:
            return restore_params(path / STATE_DIR / str(s) / "params", abstract), f"{path / STATE_DIR}/{s}"
        except Exception as e:
            errors.append(f"step {s}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    raise _bad(path, "every saved step failed to restore: " + "; ".join(errors))


# --- the target's shared tensors ---------------------------------------------------------
def _target_source(meta: dict[str, Any]) -> str:
    """Where to load the draft's target from: its registry name, else its recorded path."""
    from ssd_jax.loading.registry import REGISTRY

    t = meta["target"]
    name, path = t.get("name"), t.get("path")
    if name in REGISTRY:
        return name
    for cand in (path, name):
        if cand and Path(cand).expanduser().exists():
            return str(Path(cand).expanduser())
    raise UserError(
        f"the draft's target {name!r} (recorded path {path!r}) is neither a registered model nor an "
        f"existing path; the draft cannot be used without it (it shares the target's embeddings)"
    )


def open_draft(
    path: str | os.PathLike,
    dtype: str,
    open_target: Callable[[str, str], tuple[Any, Iterator[tuple[str, np.ndarray]]]],
):
    """Resolve a draft directory: ``(NumpyModel with an empty flat, iterator of (name, array))``.

    ``open_target(name_or_path, dtype)`` is the loader's own resolver (``loading._open``);
    the target's tokenizer becomes the draft's and its shared tensors are re-attached.
    """
    path = Path(path)
    meta = read_meta(path)
    if not (path / PARAMS_DIR).is_dir() and is_draft_dir(path / BEST_DIR):
        return open_draft(path / BEST_DIR, dtype, open_target)
    try:
        cfg = draft_config(meta).replace(dtype=dtype)
        shared = [str(n) for n in meta["shared"].get("tensors", [])]
        want_sha = meta["target"]["weights_sha256"]
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(path, f"bad {DRAFT_META}: {type(e).__name__}: {e}") from None
    if any(n not in SHAREABLE for n in shared):
        raise _bad(path, f"unexpected shared tensors {shared}")
    trained, src = _restore_trained(path, cfg, list(shared))
    flat = {k: np.asarray(v) for k, v in flatten(trained).items()}

    target_name = _target_source(meta)
    tm, tensors = open_target(target_name, dtype)
    if tm.weights_sha256 != want_sha:
        raise UserError(
            f"draft {path} was trained for target {meta['target'].get('name')} with weights sha256 "
            f"{want_sha[:16]}..., but {target_name} has {str(tm.weights_sha256)[:16]}...: wrong target"
        )
    got: dict[str, np.ndarray] = {}
    for name, arr in tensors:  # keep only the shared tensors; the rest is dropped as it streams by
        if name in shared:
            got[name] = arr
    if sorted(got) != sorted(shared):
        raise UserError(
            f"target {target_name} lacks the draft's shared tensors {sorted(set(shared) - set(got))}"
        )
    specs = param_specs(cfg)
    for name, arr in got.items():
        if tuple(arr.shape) != tuple(specs[name][0]):
            raise UserError(
                f"target {target_name}: {name} has shape {arr.shape}, the draft needs {specs[name][0]}"
            )
    if dtype == "float32" and meta["shared"].get("sha256") and shared_sha256(got) != meta["shared"]["sha256"]:
        raise UserError(
            f"draft {path}: the shared tensors of target {target_name} differ from the ones it was trained with "
            f"(sha256 mismatch); retrain the draft for this target"
        )

    from ssd_jax.loading.store import np_dtype

    target_dt = np_dtype(dtype)

    def tensor_iter() -> Iterator[tuple[str, np.ndarray]]:
        for name in list(got):
            yield name, got.pop(name)
        for name in list(flat):
            a = flat.pop(name)
            yield name, (a if a.dtype == target_dt else a.astype(target_dt))

    m = NumpyModel(
        name=str(meta.get("name") or path.name),
        cfg=cfg,
        flat={},
        tokenizer=tm.tokenizer,
        weights_sha256=str(meta.get("params_sha256") or ""),
        source=src,
    )
    return m, tensor_iter()
