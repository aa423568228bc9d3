"""The target's outputs stored once for an EAGLE head's training (``--cached-windows N``).

Training a head runs the frozen target in every step; for a 1.5B target on a CPU that is most of the
step (Qwen2.5-Coder-1.5B: 28.6 s a step of 4 x 256 tokens, against 4.6 s for SmolLM2). With a cache,
the target runs once over N windows of seq_len tokens, and the steps read what a step needs from
disk: per position the target's features at the head's layers, its normed final hidden state (the
kept log-probabilities are recomputed from it at N/V of the full LM head's cost), the log-normaliser
of its full logits and its greedy token (:func:`ssd_jax.drafters.eagle.cached_targets`). The steps
then cost the head's forward and backward only, and the windows are seen for several epochs.

Layout: ``<run>/features/`` holds ``tokens.npy`` (N, T) int32, ``weights.npy`` (N, T) float32 (the
loss weight of each position), ``feats.npy`` (N, T, n·D) and ``hidden.npy`` (N, T, D) as bfloat16 bit
patterns (uint16), ``lse.npy`` and ``top.npy`` (N, T), and ``cache.json`` (what it was built from).
It is built in ``features.tmp-<pid>`` and renamed when complete, so a killed build leaves no cache
that looks whole; a rerun builds it again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from ssd_jax.errors import UserError

CACHE_DIR = "features"
ARRAYS = ("tokens", "weights", "feats", "hidden", "lse", "top")


def _bf16_bits(x) -> np.ndarray:
    import jax.numpy as jnp

    return np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)


def _from_bits(u: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.ascontiguousarray(u).view(ml_dtypes.bfloat16)


def build_cache(
    run: Path, target, layers, tokens_NxT: np.ndarray, weights_NxT: np.ndarray, *, chunk=4, log=print
):
    """Run the target over the windows and store its outputs in ``run/features`` (unless a cache built
    from the same windows and layers is there already). Returns the cache's directory."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from ssd_jax.drafters.eagle import cached_targets

    final = run / CACHE_DIR
    info = {"target_sha256": target.weights_sha256, "layers": list(layers), "windows": int(tokens_NxT.shape[0]),
            "seq_len": int(tokens_NxT.shape[1]),
            "tokens_sha256": __import__("hashlib").sha256(tokens_NxT.tobytes()).hexdigest()}  # fmt: skip
    if (final / "cache.json").exists():
        if json.loads((final / "cache.json").read_text()) == info:
            return final
        raise UserError(f"{final} was built from other windows or layers: remove it or use another --out")
    N, T = tokens_NxT.shape
    D, F = target.cfg.hidden_size, len(layers) * target.cfg.hidden_size
    tmp = run / f"{CACHE_DIR}.tmp-{os.getpid()}"
    for old in run.glob(f"{CACHE_DIR}.tmp-*"):  # a killed build's leftovers
        shutil.rmtree(old, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.save(tmp / "tokens.npy", tokens_NxT.astype(np.int32))
    np.save(tmp / "weights.npy", weights_NxT.astype(np.float32))
    mm = {
        "feats": np.lib.format.open_memmap(tmp / "feats.npy", "w+", np.uint16, (N, T, F)),
        "hidden": np.lib.format.open_memmap(tmp / "hidden.npy", "w+", np.uint16, (N, T, D)),
        "lse": np.lib.format.open_memmap(tmp / "lse.npy", "w+", np.float32, (N, T)),
        "top": np.lib.format.open_memmap(tmp / "top.npy", "w+", np.int32, (N, T)),
    }
    fn = jax.jit(lambda p, t: cached_targets(p, target.cfg, t, tuple(layers)))
    for i in tqdm(range(0, N, chunk), desc="target features", disable=None):
        f, h, lse, top = fn(target.params, jnp.asarray(tokens_NxT[i : i + chunk]))
        mm["feats"][i : i + chunk] = _bf16_bits(f)
        mm["hidden"][i : i + chunk] = _bf16_bits(h)
        mm["lse"][i : i + chunk] = np.asarray(lse)
        mm["top"][i : i + chunk] = np.asarray(top)
    for m in mm.values():
        m.flush()
    del mm
    (tmp / "cache.json").write_text(json.dumps(info))
    os.replace(tmp, final)
    log(f"target features for {N} windows in {final}")
    return final


class FeatureCache:
    """A built cache, memory-mapped: :meth:`batch` gives one step's arrays."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.a = {k: np.load(self.path / f"{k}.npy", mmap_mode="r") for k in ARRAYS}
        self.n = self.a["tokens"].shape[0]

    def batch(self, idx) -> tuple[np.ndarray, ...]:
        """(tokens, feats, hidden, lse, top, weights) of windows ``idx``; features as bfloat16."""
        idx = np.sort(np.asarray(idx))
        get = {k: self.a[k][idx] for k in ARRAYS}
        return (get["tokens"], _from_bits(get["feats"]), _from_bits(get["hidden"]), get["lse"], get["top"],
                get["weights"])  # fmt: skip
