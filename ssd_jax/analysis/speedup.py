"""SSD's speedup formulas (the SSD paper's Theorem 7 and Corollary 16): the predicted speedup over
AR from the hit rate, tokens per round and stage times (in target-verify units), and the
critical batch size b* above which the fast backup beats the neural one. Pure numpy.
"""

from __future__ import annotations

import numpy as np


# --- speedup model and backup policy -------------------------------------------------------
def predicted_speedup(
    p_hit: float, e_hit: float, e_miss: float, t_primary: float, t_backup: float, batch: int
) -> float:
    """SSD speedup over AR (Theorem 7, Corollary 16 for batch), times in target-verify units."""
    if not 0.0 <= p_hit <= 1.0:
        raise ValueError(f"p_hit must be in [0, 1], got {p_hit}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    q = float(p_hit) ** int(batch)
    num = p_hit * e_hit + (1.0 - p_hit) * e_miss
    return float(num / (q * max(1.0, t_primary) + (1.0 - q) * (1.0 + t_backup)))


def _speedups_over_batches(
    b: np.ndarray,
    p_hit: float,
    e_hit: float,
    e_miss_neural: float,
    e_miss_fast: float,
    t_primary: float,
    t_neural: float,
    t_fast: float,
) -> tuple[np.ndarray, np.ndarray]:
    q = float(p_hit) ** b.astype(np.float64)
    tp = max(1.0, t_primary)
    s_n = (p_hit * e_hit + (1.0 - p_hit) * e_miss_neural) / (q * tp + (1.0 - q) * (1.0 + t_neural))
    s_f = (p_hit * e_hit + (1.0 - p_hit) * e_miss_fast) / (q * tp + (1.0 - q) * (1.0 + t_fast))
    return s_n, s_f


def critical_batch_size(
    p_hit: float,
    e_hit: float,
    e_miss_neural: float,
    e_miss_fast: float,
    t_primary: float,
    t_neural: float,
    t_fast: float,
    b_max: int = 4096,
) -> int:
    """Smallest batch ``b ≥ 1`` where the fast backup's speedup ≥ the neural one's; ``b_max + 1`` if none."""
    if not 0.0 <= p_hit <= 1.0:
        raise ValueError(f"p_hit must be in [0, 1], got {p_hit}")
    b = np.arange(1, int(b_max) + 1)
    s_n, s_f = _speedups_over_batches(
        b, p_hit, e_hit, e_miss_neural, e_miss_fast, t_primary, t_neural, t_fast
    )
    wins = np.nonzero(s_f >= s_n)[0]
    return int(b[wins[0]]) if wins.size else int(b_max) + 1


def choose_backup(
    batch: int,
    p_hit: float,
    e_hit: float,
    e_miss_neural: float,
    e_miss_fast: float,
    t_primary: float,
    t_neural: float,
    t_fast: float,
) -> str:
    """``"fast"`` when the fast backup's predicted speedup at this batch is at least the neural one's."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    s_n, s_f = _speedups_over_batches(
        np.array([int(batch)]), p_hit, e_hit, e_miss_neural, e_miss_fast, t_primary, t_neural, t_fast
    )
    return "fast" if s_f[0] >= s_n[0] else "neural"
