"""The planner's measurements as typed records, cached on disk per machine, cores and model pair.

A :class:`Calibration` is what :mod:`ssd_jax.planning.calibration` measured for one (target, draft,
batch size) on this machine: the draft's acceptance α and the stage costs (:class:`Costs`), plus, for a
draft model, the rank of each target token among the draft's logits (SSD's hits are simulated on
them). It is stored as JSON under ``$SSD_JAX_KAUTO_CACHE`` (default ``<cache root>/kauto``; the cache
root is ``$SSD_JAX_CACHE`` or ``~/.cache/ssd_jax``), one file per key: device kind, jax version, the
target and the draft (a hash of their config and of a slice of their weights; a draft variant's weight
dtype and head size), the batch size, and on CPU the kernels' build and the cores this process may use.
Files are written atomically (temporary file, then rename). Delete the file (or the folder), or set
``SSD_JAX_KAUTO_RECALIBRATE=1``, to measure again.

Beside them, one record per layout (:meth:`Calibrator.round_overhead`): the fixed cost of an AR, SD and
SSD round, timed by the caller on a model whose compute is about zero, keyed by the machine (as above,
without the models) and the layout (one device, or the target's and the draft's device counts).
"""

from __future__ import annotations

import logging
import dataclasses
import hashlib
import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from ssd_jax.loading.registry import cache_root
from ssd_jax.models import kernels
from ssd_jax.planning.calibration import draft_part, target_part

log = logging.getLogger(__name__)

#: the on-disk format; a file of another format is measured again
FORMAT = 2


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds per stage at the calibration's batch size.

    ``t_verify``: the target's forward over K + 1 tokens per row, keyed by K (a few K measured);
    ``t_draft_rows``: one draft step at several row counts (SSD's build), keyed by rows; ``t_build``: SSD's
    whole build timed once ({"k", "budget", "rows", "s"}, :func:`.calibration.time_build`)."""

    t_ar: float
    t_verify: Mapping[int, float]
    t_draft_step: float = 0.0
    c_round: float = 0.0
    t_draft_rows: Mapping[int, float] | None = None
    t_build: Mapping | None = None

    @classmethod
    def from_json(cls, d: Mapping) -> Costs:
        rows = d.get("t_draft_rows")
        return cls(
            float(d["t_ar"]),
            {int(k): float(v) for k, v in d["t_verify"].items()},
            float(d.get("t_draft_step", 0.0)),
            float(d.get("c_round", 0.0)),
            None if rows is None else {int(k): float(v) for k, v in rows.items()},
            d.get("t_build"),
        )

    def to_json(self) -> dict:
        out = {
            "t_ar": self.t_ar,
            "t_verify": {str(k): v for k, v in self.t_verify.items()},
            "t_draft_step": self.t_draft_step,
            "c_round": self.c_round,
        }
        if self.t_draft_rows is not None:
            out["t_draft_rows"] = {str(k): v for k, v in self.t_draft_rows.items()}
        if self.t_build is not None:
            out["t_build"] = dict(self.t_build)
        return out


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One measurement (see the module docstring); ``source`` says whether this run made it
    ("measured") or read it ("cache"), ``path`` where it is stored."""

    alpha: float
    alpha_source: str
    costs: Costs
    ranks: tuple[tuple[int, ...], ...] = ()
    rank_start: int = 0
    source: str = "measured"
    path: Path | None = None

    @classmethod
    def from_json(cls, d: Mapping, source: str = "cache", path: Path | None = None) -> Calibration:
        return cls(
            float(d["alpha"]),
            str(d.get("alpha_source", "measured")),
            Costs.from_json(d["costs"]),
            tuple(tuple(int(x) for x in r) for r in d.get("ranks", ())),
            int(d.get("rank_start", 0)),
            source,
            path,
        )

    @property
    def has_ranks(self) -> bool:
        return bool(self.ranks)

    def rank_arrays(self) -> list[np.ndarray]:
        return [np.asarray(r, np.int64) for r in self.ranks]


def kauto_dir() -> Path:
    return Path(os.environ.get("SSD_JAX_KAUTO_CACHE") or cache_root() / "kauto").expanduser()


def fingerprint(model) -> str:
    """A model's identity for the cache: its config and a slice of its weights (they decide α)."""
    h = hashlib.sha256(repr(model.cfg).encode())
    emb = model.params["embed"] if isinstance(model.params, dict) and "embed" in model.params else None
    leaf = emb if emb is not None else jax.tree.leaves(model.params)[0]
    h.update(np.asarray(leaf[:4]).tobytes())
    return h.hexdigest()[:16]


def draft_desc(spec, draft, rand_vocab: int) -> dict:
    """The draft's part of a key: the drafter, and for a model its weights' dtype and head size."""
    if spec.draft == "ngram":
        return {"kind": "ngram", "n_min": spec.prompt_lookup_min, "n_max": spec.prompt_lookup_max}
    if spec.draft == "random":
        return {"kind": "random", "vocab": rand_vocab}
    from ssd_jax.drafters.vocab import head_vocab

    return {
        "kind": "model",
        "model": fingerprint(draft),
        "weight_dtype": draft.cfg.weight_dtype,
        "head": head_vocab(draft),
    }


def machine_fields(**what) -> tuple[dict, str]:
    """(the key's fields: ``what`` and the machine it was measured on; their hash: the file's name)."""
    dev = jax.devices()[0]
    fields = {
        "format": FORMAT,
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "jax": jax.__version__,
    }
    fields.update(what)
    if dev.platform == "cpu":  # the stage costs depend on the CPU kernels' code and the cores allowed
        fields["kernels"] = kernels.build_id()
        fields["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return fields, hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def machine_key(model, desc: dict, batch: int) -> tuple[dict, str]:
    """(the key's fields, their hash: the file's name) of a calibration of ``model`` with drafter ``desc``."""
    return machine_fields(target=fingerprint(model), draft=desc, batch=batch)


def rand_vocab(model) -> int:
    tok = model.tokenizer
    return tok.vocab_size if tok is not None else model.cfg.vocab_size


def ssd_rows(batch: int) -> tuple[int, ...]:
    """Row counts at which SSD's calibration times a draft step (its build runs B·M rows a step)."""
    return tuple(sorted({batch, 4 * batch, 12 * batch, 28 * batch}))


def _recalibrate() -> bool:
    return bool(os.environ.get("SSD_JAX_KAUTO_RECALIBRATE"))


class Calibrator:
    """Reads or measures calibrations for one target; the target's side of a measurement (its greedy
    continuation, its step costs at a batch size) is made once and shared by every draft measured.
    ``overhead``: SSD's fixed cost a round once :meth:`round_overhead` has read or measured it."""

    def __init__(self, model):
        self.model = model
        self._parts: dict[int, dict] = {}
        self._seq = None
        self.overhead = None
        self.overhead_record: dict | None = None

    def round_overhead(self, layout: dict, measure) -> dict:
        """The fixed cost a round on ``layout`` (``{"target_devices": n, "draft_devices": m}``, or empty for
        one device): ``measure()`` returns seconds a round of AR, SD and SSD (``ar_s``, ``sd_s``,
        ``ssd_s``) where compute is about zero; cached on disk."""
        fields, key = machine_fields(kind="round-overhead", layout=layout)
        path = kauto_dir() / f"{key}.json"
        if not _recalibrate() and (rec := read_json(path)) is not None:
            return {**rec["costs"], "source": "cache", "cache_file": str(path)}
        costs = {k: float(v) for k, v in measure().items()}
        write_atomic(path, {**fields, "costs": costs})
        return {**costs, "source": "measured", "cache_file": str(path)}

    def _target_part(self, batch: int) -> dict:
        if batch not in self._parts:  # the continuation is the same at every batch size: made once
            self._parts[batch] = target_part(self.model, batch, seq=self._seq)
            self._seq = self._parts[batch]["seq"]
        return self._parts[batch]

    def record(self, spec, draft, batch: int) -> Calibration:
        """The calibration of ``spec``'s drafter (``draft``: the loaded model, or None) at ``batch`` rows.
        SSD needs the draft's step at several row counts: a record made for SD is measured again."""
        rv = rand_vocab(self.model)
        fields, key = machine_key(self.model, draft_desc(spec, draft, rv), batch)
        path = kauto_dir() / f"{key}.json"
        rec = read_json(path)
        rows = ssd_rows(batch) if spec.method == "ssd" and draft is not None else ()
        if rec is not None and (not rows or "t_build" in rec["costs"]) and not _recalibrate():
            return Calibration.from_json(rec, "cache", path)
        rec = {**fields, **draft_part(spec, draft, self._target_part(batch), rv, rows)}
        write_atomic(path, rec)
        return Calibration.from_json(rec, "measured", path)

    def target_costs(self, batch: int) -> Calibration:
        """The target's ``t_ar`` and ``t_verify`` at ``batch`` rows alone (α 0, no draft): for drafts
        priced without a calibration of their own (an EAGLE-style head)."""
        fields, key = machine_key(self.model, {"kind": "target-costs"}, batch)
        path = kauto_dir() / f"{key}.json"
        rec = read_json(path)
        if rec is not None and not _recalibrate():
            return Calibration(0.0, "none", Costs.from_json(rec["costs"]), source="cache", path=path)
        part = target_part(self.model, batch)
        costs = Costs(part["t_ar"], dict(part["t_verify"]))
        write_atomic(path, {**fields, "costs": costs.to_json()})
        return Calibration(0.0, "none", costs, source="measured", path=path)


def read_json(path: Path) -> dict | None:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("format") == FORMAT and "costs" in rec else None


def write_atomic(path: Path, rec: dict) -> None:
    """Temporary file, then rename: readers see the old file, the new one or none, never half of one.
    An unwritable cache is not an error (the run goes on with what it measured)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(rec, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning(f"warning: k=auto calibration not cached ({e})")
