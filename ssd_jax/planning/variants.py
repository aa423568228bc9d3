"""The draft's variant: its weight dtype and output-head size, chosen by the calibrated expected speedup.

Every variant is exact (the draft only proposes; q is 0 outside a trimmed head); only speed and
acceptance differ, and a calibration (:mod:`ssd_jax.planning.records`) measures both, α with the
variant's own head. :func:`draft_variants` lists the variants worth measuring on this hardware;
:func:`score` prices one calibration for the spec's method (SD's S(K), or SSD's round model).
"""

from __future__ import annotations

import logging
import dataclasses

import jax

from ssd_jax.errors import UserError
from ssd_jax.models import kernels
from ssd_jax.planning.sd_model import best_k, speedups_of
from ssd_jax.planning.ssd_model import best_ssd_plan

log = logging.getLogger(__name__)

#: a draft whose weight matrices stream fewer bytes than this per step is not offered bfloat16
#: weights: its weights stay in the caches, so halving them saves nothing (and tiny test models
#: are not calibrated twice)
BF16_MIN_BYTES = 32 << 20
#: the head size tried for a draft with a large, untrimmed vocabulary (a 152k-token head is most
#: of a 0.5B draft's bytes per step; 32,768 tokens cover ~99% of the offline corpus)
TRIM_TRY = 32768


def two_meshes(spec) -> bool:
    return spec.target_devices is not None or spec.draft_devices is not None


def ssd_best(cal, spec, batch: int, overhead=None) -> dict | None:
    """SSD's best round for ``spec`` from ``cal`` (None for SD or an SD-only calibration); ``overhead``:
    SSD's fixed cost a round (:class:`.ssd_model.Overhead`, None: not measured)."""
    if spec.method != "ssd":
        return None
    n_dd = (spec.draft_devices or 1) if two_meshes(spec) else 1
    return best_ssd_plan(cal, spec, batch, two_meshes(spec), n_dd, overhead)


def score(cal, spec, batch: int, overhead=None) -> tuple[int, float]:
    """(K, expected speedup over AR) of the best round for ``spec``'s method from ``cal``."""
    if (b := ssd_best(cal, spec, batch, overhead)) is not None:
        return b["k"], b["expected_speedup"]
    sp = speedups_of(cal)
    k = best_k(sp) if spec.k == "auto" else int(spec.k)
    return k, sp.get(k, max(sp.values()))


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


def apply_variant(draft, dtype: str | None, vocab: int | None, load):
    """``draft`` as it will run: weights cast to ``dtype`` (cast once, before trimming), head trimmed
    to ``vocab`` tokens (None: as it is)."""
    from ssd_jax.drafters.vocab import trimmed_draft
    from ssd_jax.loading.loaded import with_weight_dtype

    if dtype is not None:
        draft = with_weight_dtype(draft, dtype)
    if vocab is not None:
        draft = trimmed_draft(draft, vocab, load)
    return draft


def measure_variants(calibrator, spec, draft, batch: int, load) -> tuple[list[dict], bool]:
    """(one row per variant measured: dtype, vocabulary, α, draft step, K and expected speedup; whether
    any was measured rather than read from the cache)."""
    rows, measured = [], False
    for dt, dv in draft_variants(calibrator.model, spec, draft):
        try:
            v = apply_variant(draft, dt, dv, load)
        except (OSError, UserError) as e:  # e.g. no corpus to count tokens on: skip the variant
            log.warning(f"warning: draft vocabulary {dv} not tried ({e})")
            continue
        cal = calibrator.record(dataclasses.replace(spec, draft=v), v, batch)
        measured |= cal.source == "measured"
        k, s = score(cal, spec, batch, calibrator.overhead)
        rows.append(
            {
                "draft_dtype": dt,
                "draft_vocab": dv,
                "alpha": cal.alpha,
                "t_draft_step": cal.costs.t_draft_step,
                "k": k,
                "expected_speedup": round(s, 4),
            }
        )
    return rows, measured


def fixed_variant(spec) -> tuple[str | None, int | None]:
    """The variant when nothing is left to choose: "auto" fields become the draft as it is."""
    return (
        None if spec.draft_dtype == "auto" else spec.draft_dtype,
        None if spec.draft_vocab == "auto" else spec.draft_vocab,
    )


def forget_unchosen(draft, model, spec, chosen) -> None:
    _forget_others(draft, draft_variants(model, spec, draft), chosen)
