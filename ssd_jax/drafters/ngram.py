"""Prompt-lookup drafting (vLLM's ``prompt_lookup_min/max``): propose what followed the most recent
earlier occurrence of the context's last n tokens. Host-side numpy; proposals are point masses.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ssd_jax.drafters.base import Proposal


def ngram_lookup(history: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Tokens that followed the most recent earlier occurrence of the history's last n tokens.

    Tries n = n_max down to n_min; returns up to k tokens (empty if nothing matches).
    """
    L = len(history)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = history[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(history[: L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < L]  # something must follow the match
        if hits.size:
            s = hits[-1] + n
            return history[s : s + k]
    return history[:0]


def ngram_proposals(histories: list[np.ndarray], k: int, n_min: int, n_max: int, rows=None):
    """(tokens (B, k) int32, counts (B,) int32): the lookup for each row in ``rows`` (default all);
    other rows and unmatched ones propose nothing. The one n-gram proposer (SD's drafter, SSD's
    n-gram backup)."""
    B = len(histories)
    toks = np.zeros((B, k), np.int32)
    n = np.zeros((B,), np.int32)
    for b in range(B) if rows is None else rows:
        got = ngram_lookup(histories[b], k, n_min, n_max)
        toks[b, : len(got)] = got
        n[b] = len(got)
    return toks, n


class NgramDrafter:
    """Prompt-lookup drafting on the host; proposals are point masses."""

    kind = "ngram"
    compile_s = 0.0
    needs_history = True

    def __init__(self, k: int, n_min: int = 1, n_max: int = 4):
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self._put = jnp.asarray

    def start(self, tokens_BxT, n_valid_B, max_len: int, put) -> float:
        self._put = put
        return 0.0

    def prefill(self) -> None:
        pass

    def precompile(self, *a) -> float:
        return 0.0

    def propose(self, prev_B, cur_B, key, rs, history: list[np.ndarray] | None = None) -> Proposal:
        toks, n = ngram_proposals(history, self.k, self.n_min, self.n_max)
        return Proposal(self._put(toks), self._put(n), None)

    def commit(self, lengths_B, all_accepted: bool = True) -> None:
        pass
