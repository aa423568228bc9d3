"""``--k auto``: choose K from a short measurement on this machine, cached on disk.

:func:`resolve_k` turns ``SpecConfig(k="auto")`` into an integer K before the method's loop
runs (for SD it also hands the loop a :class:`~ssd_jax.analysis.kchoice.KPlan`, with which the
loop chooses K again after every round from the run's own acceptance). The choice maximises the expected speedup (:mod:`ssd_jax.analysis.kchoice`)::

    S(K) = E(α, K) · t_ar / (c_round + K · t_draft_step + t_verify(K + 1)),   K in 1..8

from one calibration (:func:`calibrate`) made at the run's batch size B:

* ``t_ar``: median time of the target's compiled one-token decode step (greedy AR continuation
  of fixed built-in prompts, :data:`CAL_TEXTS`, or fixed token ids for a model without a
  tokenizer: :data:`P_LEN` prompt tokens, :data:`N_GEN` generated);
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
per (device kind, jax version, target, draft, batch size; on CPU also the kernels' build), written atomically (temporary file,
then rename). The target and a draft model are identified by a hash of their config and of a
slice of their weights. K is recomputed from the stored α and costs, so the same cache gives the
same K (and a seeded run the same tokens). Delete the file (or the folder), or set
``SSD_JAX_KAUTO_RECALIBRATE=1``, to measure again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
import uuid
from pathlib import Path

import jax
import numpy as np

from ssd_jax.analysis.kchoice import K_MAX, KPlan, best_k, expected_speedups, interpolate_verify
from ssd_jax.decoding.sd import sd_steps
from ssd_jax.drafters.base import check_same_tokenizer
from ssd_jax.drafters.ngram import ngram_lookup, ngram_proposals
from ssd_jax.loading.registry import cache_root
from ssd_jax.models import kernels
from ssd_jax.parallel.placement import cache_for, put_on

__all__ = ["ALPHA_PRIOR", "CAL_TEXTS", "calibrate", "kauto_dir", "resolve_k"]

FORMAT = 1
CAL_TEXTS = (
    "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):\n"
    "        if n % i == 0:\n            return False\n    return True\n",
    "The river flows from the mountains to the sea. Along the way it passes forests, fields and "
    "small towns, where people fish, swim and watch the boats go by.",
)
P_LEN, N_GEN, REPS = 16, 32, 5
VERIFY_KS = (1, 4, 8)
ALPHA_PRIOR = 0.6


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
    return {"kind": "model", "model": _fingerprint(draft)}


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
    if dev.platform == "cpu":  # the stage costs depend on the CPU kernels' code
        fields["kernels"] = kernels.build_id()
    return fields, hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def resolve_k(model, spec, sampling, batch: int, load):
    """(spec with an integer k, the ``k_auto`` metric or None, seconds spent) for a run of ``batch`` rows.

    Only ``k == "auto"`` with SD / SSD does anything; a draft named by a string is loaded here
    (once: the loaded model goes into the returned spec)."""
    if spec.k != "auto":
        return spec, None, 0.0
    if spec.method == "ar":
        return dataclasses.replace(spec, k=1), None, 0.0  # AR ignores k
    draft = None
    if spec.draft not in ("ngram", "random"):
        draft = load(spec.draft) if isinstance(spec.draft, str) else spec.draft
        check_same_tokenizer(model, draft)
        spec = dataclasses.replace(spec, draft=draft)
    tok = model.tokenizer
    rand_vocab = tok.vocab_size if tok is not None else model.cfg.vocab_size
    fields, key = _key(model, _draft_desc(spec, draft, rand_vocab), batch)
    path = kauto_dir() / f"{key}.json"
    rec, source, t0 = _read(path), "cache", time.perf_counter()
    if rec is None or os.environ.get("SSD_JAX_KAUTO_RECALIBRATE"):
        rec, source = {**fields, **calibrate(model, spec, draft, batch, rand_vocab)}, "measured"
        _write_atomic(path, rec)
    c = rec["costs"]
    sp = expected_speedups(
        rec["alpha"],
        c["t_ar"],
        interpolate_verify({int(k): v for k, v in c["t_verify"].items()}),
        c["t_draft_step"],
        c["c_round"],
    )
    k = best_k(sp)
    # SD re-chooses K each round from its own acceptance (kchoice.OnlineK); SSD's fan-out fixes K
    plan = KPlan.from_costs(rec["alpha"], c, k) if spec.method == "sd" else None
    info = {
        "alpha": rec["alpha"],
        "alpha_source": rec["alpha_source"],
        "costs": c,
        "expected_speedup_by_k": {str(i): round(s, 4) for i, s in sp.items()},
        "source": source,
        "cache_file": str(path),
        "calibration_s": time.perf_counter() - t0 if source == "measured" else 0.0,
    }
    return dataclasses.replace(spec, k=k, k_plan=plan), info, info["calibration_s"]


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


# --- the measurement ----------------------------------------------------------------------


def _cal_ids(model, n_rows: int) -> np.ndarray:
    """(rows, P_LEN) fixed prompt ids: the built-in texts, or seeded ids without a tokenizer."""
    V = model.cfg.vocab_size
    if model.tokenizer is not None:
        base = [
            [t for t in model.tokenizer.encode(s, add_special_tokens=False) if 0 <= t < V] for s in CAL_TEXTS
        ]
    else:
        rng = np.random.default_rng(0)
        base = [rng.integers(2, V, P_LEN).tolist() for _ in CAL_TEXTS]
    base = [np.resize(np.asarray(b or [0], np.int32), P_LEN) for b in base]
    return np.stack([base[b % len(base)] for b in range(n_rows)])


def _median_time(fn, reps: int = REPS) -> float:
    fn()  # warm: compiles on the first call
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def _step_through(model, seq: np.ndarray, start: int, max_len: int, generate: bool):
    """Feed ``seq`` (B, L) to ``model`` one token per compiled call (the 1-token verify forward, logits
    included). With ``generate``, positions after ``start`` are overwritten by the greedy continuation.
    Returns (the model's argmax after each position (B, L - 1), median seconds per step from position
    ``start`` on, the cache holding positions 0..L-2)."""
    B, L = seq.shape
    put = functools.partial(put_on, model)
    score, _ = sd_steps(model.cfg, False)
    cache, none = cache_for(model, B, max_len), put(np.zeros((B, 0), np.int32))
    pred, times = np.zeros((B, L - 1), np.int32), []
    for i in range(L - 1):
        tok = put(seq[:, i])
        t = time.perf_counter()
        logits, cache = score(model.params, cache, tok, none)
        logits.block_until_ready()
        if i >= start:
            times.append(time.perf_counter() - t)
        cache = cache.with_lengths(cache.lengths + 1)
        pred[:, i] = np.asarray(logits[:, 0]).argmax(-1)
        if generate and i + 1 > start:
            seq[:, i + 1] = pred[:, i]
    return pred, float(np.median(times)) if times else None, cache


def _simulate_alpha(seq: np.ndarray, start: int, propose) -> tuple[int, int]:
    """(accepted, rejections) of greedy SD rounds at K = K_MAX over one row's continuation."""
    acc = rej = 0
    t = start
    while t + K_MAX <= len(seq):
        prop = np.asarray(propose(t))[:K_MAX]
        match = prop == seq[t : t + len(prop)]
        a = int(np.argmin(match)) if not match.all() else len(prop)
        acc, rej, t = acc + a, rej + (a < len(prop)), t + a + 1
    return acc, rej


def calibrate(model, spec, draft, batch: int, rand_vocab: int) -> dict:
    """Measure α and the stage costs (seconds) at ``batch`` rows; see the module docstring."""
    n_gen = max(0, min(N_GEN, model.cfg.max_position_embeddings - P_LEN - 2 * K_MAX - 2))
    max_len = P_LEN + n_gen + 2 * K_MAX + 2
    put = functools.partial(put_on, model)
    B = batch
    seq = np.zeros((B, P_LEN + 1 + n_gen), np.int32)  # prompt, then the target's greedy continuation
    seq[:, :P_LEN] = _cal_ids(model, B)
    _, t_ar, cache = _step_through(model, seq, P_LEN - 1, max_len, generate=True)
    score, _ = sd_steps(model.cfg, False)
    state = {"cache": cache}
    cur = put(seq[:, -1])

    def verify(k):
        zk = put(np.zeros((B, k), np.int32))

        def run():
            logits, state["cache"] = score(model.params, state["cache"], cur, zk)
            logits.block_until_ready()

        return run

    t_verify = {k: _median_time(verify(k)) for k in VERIFY_KS}
    if t_ar is None:
        t_ar = t_verify[1]
    rows = min(B, len(CAL_TEXTS))
    acc = rej = 0
    t_draft_step = c_round = 0.0
    alpha_source = "measured"
    if spec.draft == "random":
        alpha, alpha_source = 1.0 / rand_vocab, "exact"
    elif spec.draft == "ngram":
        hist = [seq[b] for b in range(B)]
        c_round = _median_time(
            lambda: ngram_proposals(hist, K_MAX, spec.prompt_lookup_min, spec.prompt_lookup_max)
        )
        for b in range(rows):
            a, r = _simulate_alpha(
                seq[b],
                P_LEN + 1,
                lambda t, b=b: ngram_lookup(
                    seq[b, :t], K_MAX, spec.prompt_lookup_min, spec.prompt_lookup_max
                ),
            )
            acc, rej = acc + a, rej + r
    else:
        # the draft teacher-forced on the target's tokens, one step per call (timed): its greedy proposal
        # j of a round is right exactly when proposals 1..j are, so the leading matches are its rounds
        pred, t_draft_step, _ = _step_through(draft, seq, P_LEN, max_len, generate=False)
        for b in range(rows):
            a, r = _simulate_alpha(seq[b], P_LEN + 1, lambda t, b=b: pred[b, t - 1 : t - 1 + K_MAX])
            acc, rej = acc + a, rej + r
    if spec.draft != "random":
        if acc + rej:
            alpha = acc / (acc + rej)
        else:
            alpha, alpha_source = (
                (0.0, "measured") if spec.draft == "ngram" and n_gen else (ALPHA_PRIOR, "prior")
            )
    costs = {
        "t_ar": t_ar,
        "t_verify": {str(k): v for k, v in t_verify.items()},
        "t_draft_step": t_draft_step,
        "c_round": c_round,
    }
    return {
        "alpha": float(alpha),
        "alpha_source": alpha_source,
        "costs": costs,
        "calibration_tokens": int(rows * (seq.shape[1] - P_LEN)),
    }
