"""``--k auto``: choose K from a short measurement on this machine, cached on disk.

:func:`resolve_k` turns ``SpecConfig(k="auto")`` into an integer K before the method's loop
runs (for SD it also hands the loop a :class:`~ssd_jax.analysis.kchoice.KPlan`, with which the
loop chooses K again after every round from the run's own acceptance). The choice maximises the expected speedup (:mod:`ssd_jax.analysis.kchoice`)::

    S(K) = E(α, K) · t_ar / (c_round + K · t_draft_step + t_verify(K + 1)),   K in 1..8

from one calibration (:func:`calibrate`) made at the run's batch size B. The target first continues
every built-in prompt greedily (:data:`N_GEN` tokens after :data:`P_LEN` prompt ids, one row
each whatever B: raw code and prose, :data:`CAL_TEXTS`, and chat requests in the model's chat
template, :data:`CAL_CHATS`; seeded token ids for a model without a tokenizer); acceptance is
measured on those rows, the costs at B rows:

* ``t_ar``: median time of the target's compiled one-token decode step (:data:`TIMED_STEPS`
  steps of B rows);
* ``t_verify(K+1)``: median time of the compiled verify forward (``sd.target_score``) at K + 1
  tokens per row for K in :data:`VERIFY_KS`; the other K are linearly interpolated;
* ``t_draft_step``: the draft model's compiled one-token forward with its logits (0 for n-gram /
  random);
* ``c_round``: the host's n-gram lookup for the batch (0 for model / random drafts);
* ``α``: the draft's GREEDY acceptance on the target's greedy continuation, by an offline
  simulation of SD rounds at K = 8 (the draft's argmax on the target's tokens, teacher-forced
  in one forward; n-gram: the lookup itself), as the maximum-likelihood estimate of a
  geometric acceptance: accepted / (accepted + rejections). Random proposals: α = 1/V (the
  chance that a uniform token is the target's argmax). Sampled runs use the same α.
  :data:`ALPHA_PRIOR` is used (``alpha_source: "prior"``) only when the continuation gives no
  evidence (a context window too short to calibrate in).

The measurement is stored as JSON under ``$SSD_JAX_KAUTO_CACHE`` (default
``<cache root>/kauto``; the cache root is ``$SSD_JAX_CACHE`` or ``~/.cache/ssd_jax``), one file
per (device kind, jax version, target, draft, batch size; on CPU also the kernels' build and the number of cores the process may use), written atomically (temporary file,
then rename). The target and a draft model are identified by a hash of their config and of a
slice of their weights. K is recomputed from the stored α and costs, so the same cache gives the
same K (and a seeded run the same tokens). Delete the file (or the folder), or set
``SSD_JAX_KAUTO_RECALIBRATE=1``, to measure again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import uuid
from pathlib import Path

import jax
import numpy as np

from ssd_jax.analysis.kchoice import K_MAX, BucketPlans, KPlan, best_k, expected_speedups, interpolate_verify
from ssd_jax.decoding.calibration import ALPHA_PRIOR, CAL_TEXTS, calibrate, draft_part, target_part
from ssd_jax.drafters.base import check_same_tokenizer
from ssd_jax.loading.registry import cache_root
from ssd_jax.errors import UserError
from ssd_jax.models import kernels
from ssd_jax.parallel.distributed import agree, multi_process

__all__ = [
    "ALPHA_PRIOR",
    "CAL_TEXTS",
    "calibrate",
    "choose_draft_variant",
    "draft_variants",
    "kauto_dir",
    "resolve_k",
]

FORMAT = 2


def kauto_dir() -> Path:
    return Path(os.environ.get("SSD_JAX_KAUTO_CACHE") or cache_root() / "kauto").expanduser()


def _fingerprint(model) -> str:
    h = hashlib.sha256(repr(model.cfg).encode())
    emb = model.params["embed"] if isinstance(model.params, dict) and "embed" in model.params else None
    leaf = emb if emb is not None else jax.tree.leaves(model.params)[0]
    h.update(np.asarray(leaf[:4]).tobytes())  # weights, not only the shape, decide α
    return h.hexdigest()[:16]


def _draft_desc(spec, draft, rand_vocab: int) -> dict:
    if spec.draft == "ngram":
        return {"kind": "ngram", "n_min": spec.prompt_lookup_min, "n_max": spec.prompt_lookup_max}
    if spec.draft == "random":
        return {"kind": "random", "vocab": rand_vocab}
    from ssd_jax.drafters.vocab import head_vocab

    # the weights' dtype and the head's size name the variant (a trimmed head shares the embedding)
    return {
        "kind": "model",
        "model": _fingerprint(draft),
        "weight_dtype": draft.cfg.weight_dtype,
        "head": head_vocab(draft),
    }


def _key(model, desc: dict, batch: int) -> tuple[dict, str]:
    dev = jax.devices()[0]
    fields = {
        "format": FORMAT,
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "jax": jax.__version__,
        "target": _fingerprint(model),
        "draft": desc,
        "batch": batch,
    }
    if dev.platform == "cpu":  # the stage costs depend on the CPU kernels' code and the cores allowed
        fields["kernels"] = kernels.build_id()
        fields["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return fields, hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def _rand_vocab(model) -> int:
    tok = model.tokenizer
    return tok.vocab_size if tok is not None else model.cfg.vocab_size


def _ssd_rows(batch: int) -> tuple[int, ...]:
    """Row counts at which SSD's calibration times a draft step (its build runs B·M rows a step)."""
    return tuple(sorted({batch, 4 * batch, 12 * batch, 28 * batch}))


def _needs_rows(spec, draft) -> bool:
    return spec.method == "ssd" and draft is not None


def _record(model, spec, draft, batch: int, target: dict) -> tuple[dict, str, Path]:
    """(the calibration record of this target / draft / batch, "cache" or "measured", its file).
    ``target`` memoises the target's side of a measurement across the drafts measured in one call.
    SSD needs the draft's step at several row counts: a record made for SD is measured again."""
    rand_vocab = _rand_vocab(model)
    fields, key = _key(model, _draft_desc(spec, draft, rand_vocab), batch)
    path = kauto_dir() / f"{key}.json"
    rec = _read(path)
    rows = _ssd_rows(batch) if _needs_rows(spec, draft) else ()
    complete = rec is not None and (not rows or "t_draft_rows" in rec["costs"])
    if complete and not os.environ.get("SSD_JAX_KAUTO_RECALIBRATE"):
        return rec, "cache", path
    if ("part", batch) not in target:  # the continuation is the same at every batch size: made once
        target[("part", batch)] = target_part(model, batch, seq=target.get("seq"))
        target["seq"] = target[("part", batch)]["seq"]
    rec = {**fields, **draft_part(spec, draft, target[("part", batch)], rand_vocab, rows)}
    _write_atomic(path, rec)
    return rec, "measured", path


def _two_meshes(spec) -> bool:
    return spec.target_devices is not None or spec.draft_devices is not None


def _ssd_plans(rec: dict, spec, batch: int) -> list[dict]:
    """SSD's candidate rounds (:func:`.ssd.plan.round_plans`) within what the spec fixes: a given K,
    a given fan-out budget or uniform fan-out, budgets that divide over the draft devices."""
    from ssd_jax.decoding.ssd.plan import M_PER_POSITION, round_plans

    ks = range(1, K_MAX + 1) if spec.k == "auto" else [int(spec.k)]
    n_dd = (spec.draft_devices or 1) if _two_meshes(spec) else 1
    budgets = {}
    for k in ks:
        if spec.fan_out != "geometric":
            budgets[k] = [int(spec.fan_out) * (k + 1)]
        elif spec.fan_out_budget is not None:
            budgets[k] = [int(spec.fan_out_budget)]
        else:
            budgets[k] = sorted({-(-m * (k + 1) // n_dd) * n_dd for m in M_PER_POSITION})
    return round_plans(rec, batch, _two_meshes(spec), ks, budgets)


def _ssd_best(rec: dict, spec, batch: int) -> dict | None:
    """SSD's best round plan for this record (:func:`.ssd.plan.best_plan`), or None for SD or a
    record without the draft's step at several row counts."""
    if spec.method != "ssd" or "t_draft_rows" not in rec["costs"]:
        return None
    from ssd_jax.decoding.ssd.plan import best_plan

    plans = _ssd_plans(rec, spec, batch)
    return best_plan(plans) if plans else None


def _score(rec: dict, spec, batch: int) -> tuple[int, float]:
    """(K, expected speedup over AR) of the best round for ``spec``'s method: SD's K model
    (:func:`ssd_jax.analysis.kchoice.expected_speedups`), or SSD's round model."""
    if (b := _ssd_best(rec, spec, batch)) is not None:
        return b["k"], b["expected_speedup"]
    sp = _speedups(rec)
    k = best_k(sp) if spec.k == "auto" else int(spec.k)
    return k, sp.get(k, max(sp.values()))


def _speedups(rec: dict) -> dict[int, float]:
    c = rec["costs"]
    return expected_speedups(
        rec["alpha"],
        c["t_ar"],
        interpolate_verify({int(k): v for k, v in c["t_verify"].items()}),
        c["t_draft_step"],
        c["c_round"],
    )


def _bucket_plan(model, spec, draft, bucket: int, full, batch: int, target: dict) -> tuple[int, KPlan]:
    """(bucket, its plan): the calibration at ``bucket`` rows (``full``, the plan at ``batch``, for it)."""
    if bucket == batch:
        return bucket, full
    rec, _, _ = _record(model, spec, draft, bucket, target)
    return bucket, KPlan.from_costs(rec["alpha"], rec["costs"], best_k(_speedups(rec)), zero=True)


def resolve_k(model, spec, sampling, batch: int, load, target: dict | None = None, buckets=()):
    """(spec with an integer k, the ``k_auto`` metric or None, seconds spent) for a run of ``batch`` rows.

    Only ``k == "auto"`` with SD / SSD does anything; a draft named by a string is loaded here
    (once: the loaded model goes into the returned spec). ``buckets``: the engine's batch buckets; with
    several, one-device SD gets a plan per bucket (:class:`~ssd_jax.analysis.kchoice.BucketPlans`),
    each calibrated at that many rows."""
    if spec.k != "auto":
        return spec, None, 0.0
    if spec.method == "ar":
        return dataclasses.replace(spec, k=1), None, 0.0  # AR ignores k
    draft = None
    if spec.draft not in ("ngram", "random"):
        draft = load(spec.draft) if isinstance(spec.draft, str) else spec.draft
        check_same_tokenizer(model, draft)
        spec = dataclasses.replace(spec, draft=draft)
    t0 = time.perf_counter()
    target = {} if target is None else target
    rec, source, path = _record(model, spec, draft, batch, target)
    c = rec["costs"]
    sp = _speedups(rec)
    k = best_k(sp)
    extra: dict = {}
    if (best := _ssd_best(rec, spec, batch)) is not None:  # SSD prices its own round: K and the budget
        k = best["k"]
        if spec.fan_out == "geometric" and spec.fan_out_budget is None:
            spec = dataclasses.replace(spec, fan_out_budget=best["budget"])
        extra = {"ssd_plan": best, "ssd_overlap_model": _two_meshes(spec)}
    # SD re-chooses K each round from its own acceptance (kchoice.OnlineK), K = 0 (an AR round) among the
    # candidates, and by the running rows' batch bucket when the engine has several; SSD's fan-out fixes K
    plan = None
    if spec.method == "sd":
        plan = KPlan.from_costs(rec["alpha"], c, k, zero=True)
        if len(buckets) > 1 and not _two_meshes(spec):
            plan = BucketPlans(
                tuple(_bucket_plan(model, spec, draft, b, plan, batch, target) for b in buckets)
            )
    info = {
        **extra,
        "alpha": rec["alpha"],
        "alpha_source": rec["alpha_source"],
        "costs": c,
        "expected_speedup_by_k": {str(i): round(s, 4) for i, s in sp.items()},
        "source": source,
        "cache_file": str(path),
        "calibration_s": time.perf_counter() - t0 if source == "measured" else 0.0,
    }
    return dataclasses.replace(spec, k=k, k_plan=plan), info, info["calibration_s"]


def target_costs(model, batch: int) -> tuple[dict, str, Path]:
    """(the target's ``t_ar`` and ``t_verify`` at ``batch`` rows, "cache" or "measured", the cache file):
    the target's side of a calibration alone, for drafts that are priced without one of their own (an
    EAGLE-style head, :mod:`ssd_jax.decoding.kauto_head`); cached like every calibration."""
    from ssd_jax.decoding.calibration import target_part

    fields, key = _key(model, {"kind": "target-costs"}, batch)
    path = kauto_dir() / f"{key}.json"
    rec = _read(path)
    if rec is not None and not os.environ.get("SSD_JAX_KAUTO_RECALIBRATE"):
        return rec["costs"], "cache", path
    part = target_part(model, batch)
    costs = {"t_ar": part["t_ar"], "t_verify": {str(k): v for k, v in part["t_verify"].items()}}
    _write_atomic(path, {**fields, "costs": costs})
    return costs, "measured", path


# --- the draft's variant: weight dtype and head size -----------------------------------------

#: a draft whose weight matrices stream fewer bytes than this per step is not offered bfloat16
#: weights: its weights stay in the caches, so halving them saves nothing (and tiny test models
#: are not calibrated twice)
BF16_MIN_BYTES = 32 << 20
#: the head size tried for a draft with a large, untrimmed vocabulary (a 152k-token head is most
#: of a 0.5B draft's bytes per step; 32,768 tokens cover ~99% of the offline corpus)
TRIM_TRY = 32768


def _streamed_bytes(draft) -> int:
    """Bytes of weight matrices one draft step reads: the embedding counts only as a tied head."""
    p = draft.params
    n = sum(
        x.size * x.dtype.itemsize
        for k, v in p.items()
        if k != "embed"
        for x in jax.tree.leaves(v)
        if x.ndim >= 2
    )
    if draft.cfg.tie_embeddings and "head" not in p:  # no trimmed head of its own: the embedding is the head
        n += p["embed"].size * p["embed"].dtype.itemsize
    return int(n)


def draft_variants(model, spec, draft) -> list[tuple[str | None, int | None]]:
    """The (draft_dtype, draft_vocab) pairs worth measuring for ``draft`` under ``model``: each
    "auto" field becomes the choices that can pay on this hardware, a given one stays as given.

    * dtype: the target's (None) and, for a float32 target whose draft streams at least
      :data:`BF16_MIN_BYTES` of matrices a step, "bfloat16" (on CPU only where the kernels that
      widen bfloat16 in registers run: XLA:CPU's own mixed dot is 10-20x slower);
    * vocabulary: the full head (None) and, for a draft whose untrimmed head has more than
      2 x :data:`TRIM_TRY` tokens, :data:`TRIM_TRY` (exact either way: q is 0 outside the head)."""
    from ssd_jax.drafters.vocab import head_vocab

    if spec.draft_dtype != "auto":
        dtypes = [spec.draft_dtype]
    else:
        dtypes = [None]
        on_cpu = jax.devices()[0].platform == "cpu"
        if (
            model.cfg.dtype == "float32"
            and draft.cfg.weight_dtype in (None, "float32")
            and _streamed_bytes(draft) >= BF16_MIN_BYTES
            and (not on_cpu or kernels.available())
        ):
            dtypes.append("bfloat16")
    if spec.draft_vocab != "auto":
        vocabs = [spec.draft_vocab]
    else:
        vocabs = [None]
        if head_vocab(draft) is None and draft.cfg.vocab_size > 2 * TRIM_TRY:
            vocabs.append(TRIM_TRY)
    return [(d, v) for d in dtypes for v in vocabs]


def _forget_others(draft, variants, chosen) -> None:
    """Free the variants measured but not chosen (a 0.5B draft's copies cost GBs of host memory)."""
    from ssd_jax.loading.loaded import forget_derived, with_weight_dtype

    for dt, dv in variants:
        if (dt, dv) == chosen:
            continue
        base = with_weight_dtype(draft, dt) if dt is not None else draft
        if dv is not None:
            forget_derived(base, f"vocab:{dv}")
        if dt is not None and dt != chosen[0]:
            forget_derived(draft, f"dtype:{dt}")


def choose_draft_variant(model, spec, batch: int, load, target: dict | None = None):
    """Resolve ``draft_dtype="auto"`` / ``draft_vocab="auto"`` (the defaults) for this target, draft,
    batch size and machine: the variant (:func:`draft_variants`) whose calibrated expected speedup
    (the best over K for ``k="auto"``, else at the given K) is largest. Every variant is exact; only
    speed and acceptance differ, and the calibration measures both (α is measured with the variant's
    own head). The measurements are cached as ``k="auto"``'s are, so the choice is made once.

    Returns (spec with concrete ``draft_dtype`` / ``draft_vocab`` and the loaded draft, the
    ``draft_auto`` metric or None, seconds spent measuring)."""
    if spec.draft_dtype != "auto" and spec.draft_vocab != "auto":
        return spec, None, 0.0
    if spec.method == "ar" or spec.draft is None or spec.draft in ("ngram", "random"):
        dt = None if spec.draft_dtype == "auto" else spec.draft_dtype
        dv = None if spec.draft_vocab == "auto" else spec.draft_vocab
        return dataclasses.replace(spec, draft_dtype=dt, draft_vocab=dv), None, 0.0
    from ssd_jax.drafters.vocab import trimmed_draft
    from ssd_jax.loading.loaded import with_weight_dtype

    draft = load(spec.draft) if isinstance(spec.draft, str) else spec.draft
    check_same_tokenizer(model, draft)
    spec = dataclasses.replace(spec, draft=draft)
    variants = draft_variants(model, spec, draft)
    if len(variants) == 1:
        (dt, dv), info, spent = variants[0], None, 0.0
    else:
        t0, target = time.perf_counter(), {} if target is None else target
        rows, measured = [], False
        for dt, dv in variants:
            v = with_weight_dtype(draft, dt) if dt is not None else draft
            if dv is not None:
                try:
                    v = trimmed_draft(v, dv, load)
                except (OSError, UserError) as e:  # e.g. no corpus to count tokens on: skip the variant
                    print(f"warning: draft vocabulary {dv} not tried ({e})", file=sys.stderr)
                    continue
            rec, source, _ = _record(model, dataclasses.replace(spec, draft=v), v, batch, target)
            measured |= source == "measured"
            k, s = _score(rec, spec, batch)
            rows.append(
                {
                    "draft_dtype": dt,
                    "draft_vocab": dv,
                    "alpha": rec["alpha"],
                    "t_draft_step": rec["costs"]["t_draft_step"],
                    "k": k,
                    "expected_speedup": round(s, 4),
                }
            )
        best = max(rows, key=lambda r: r["expected_speedup"])
        if multi_process() and _two_meshes(spec):  # a run across processes: all take process 0's choice
            best = rows[agree(rows.index(best))]
        dt, dv = best["draft_dtype"], best["draft_vocab"]
        _forget_others(draft, variants, (dt, dv))
        spent = time.perf_counter() - t0 if measured else 0.0
        info = {"chosen": {"draft_dtype": dt, "draft_vocab": dv}, "variants": rows, "calibration_s": spent}
    return dataclasses.replace(spec, draft_dtype=dt, draft_vocab=dv), info, spent


def _read(path: Path):
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("format") == FORMAT and "costs" in rec else None


def _write_atomic(path: Path, rec: dict) -> None:
    """Temporary file, then rename: readers see the old file, the new one or none, never half of one.
    An unwritable cache is not an error (the run goes on with what it measured)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(rec, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"warning: k=auto calibration not cached ({e})", file=sys.stderr)
