"""Acceptance accounting shared by SD and SSD (per run and per request).

``acceptance_rate`` = accepted / drafted proposals; ``mean_acceptance_length`` = tokens
emitted per verify step INCLUDING the bonus token (so plain AR would score 1.0);
``per_position_acceptance[j]`` = P(proposal j accepted | position j was reached and drafted);
``acceptance_histogram[k]`` = rounds (over live rows) that accepted exactly k proposals.

Per request, ``drafted`` counts its proposals and ``accepted_per_round`` lists the accepted count of each of its verify rounds
(the round emitted that many draft tokens plus one bonus / correction token), and for SSD
``cache_hit_per_round`` says whether that round's speculation came from the speculation
cache. The host stores one small array per round and builds the lists once at the end.
"""

from __future__ import annotations

import numpy as np


class AcceptanceStats:
    def __init__(self, batch: int, k: int):
        self.k = k
        self.hist = np.zeros(k + 1, np.int64)
        self.pos_reached = np.zeros(k, np.int64)
        self.pos_accepted = np.zeros(k, np.int64)
        self.row_rounds = np.zeros(batch, np.int64)
        self.row_drafted = np.zeros(batch, np.int64)
        self.row_accepted = np.zeros(batch, np.int64)
        self._rounds: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
        self._j = np.arange(k)[None, :]

    @property
    def n_rounds(self) -> int:
        return len(self._rounds)

    def update(
        self, live: np.ndarray, n_acc: np.ndarray, n_draft: np.ndarray, hit: np.ndarray | None = None
    ) -> None:
        """One verify round; only rows still generating (``live``) count.

        ``hit`` (SSD): per row, the verified speculation came from the speculation cache.
        """
        self._rounds.append((live.copy(), n_acc.astype(np.int64), None if hit is None else hit.astype(bool)))
        k_l, nd_l = n_acc[live], n_draft[live]
        self.hist += np.bincount(k_l, minlength=self.k + 1)
        j = self._j
        self.pos_reached += ((j <= k_l[:, None]) & (j < nd_l[:, None])).sum(0)
        self.pos_accepted += (j < k_l[:, None]).sum(0)
        self.row_rounds += live
        self.row_drafted += n_draft * live
        self.row_accepted += n_acc * live

    def row_metrics(self, b: int) -> dict:
        r, d, a = self.row_rounds[b], self.row_drafted[b], self.row_accepted[b]
        out = {
            "verify_steps": int(r),
            "drafted": int(d),
            "acceptance_rate": float(a / d) if d else 0.0,
            "mean_acceptance_length": float((a + r) / r) if r else 0.0,
            "accepted_per_round": [int(n[b]) for live, n, _ in self._rounds if live[b]],
        }
        if self._rounds and self._rounds[0][2] is not None:
            out["cache_hit_per_round"] = [bool(h[b]) for live, _, h in self._rounds if live[b]]
        return out

    def metrics(self) -> dict:
        drafted, accepted = int(self.row_drafted.sum()), int(self.row_accepted.sum())
        rounds = int(self.row_rounds.sum())
        return {
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": (accepted + rounds) / rounds if rounds else 0.0,
            "per_position_acceptance": [
                float(a / r) if r else 0.0 for a, r in zip(self.pos_accepted, self.pos_reached)
            ],
            "acceptance_histogram": self.hist.tolist(),
        }
