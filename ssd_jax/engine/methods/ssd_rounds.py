"""What a dispatched SSD round leaves in flight (:mod:`ssd_jax.engine.methods.ssd`): the round itself and,
for a split round, the lookup its second half still has to run."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass
class SSDRound:
    """A dispatched SSD round."""

    kind: str  # the backup its lookup ran: neural, random or host (n-gram)
    sched: np.ndarray  # the fan-out table its tree was built with
    out: jax.Array  # (B, K+2[+META]) emitted tokens, accepted count (fused: then the next speculation's meta)
    meta: jax.Array | None = None  # (B, META) the next speculation's meta (split rounds)
    host: np.ndarray | None = None  # the round's host copy, once read
    lookup: Lookup | None = None  # a split round whose lookup has not run yet (SSD._finish runs it)


@dataclasses.dataclass
class Lookup:
    """What a split round's second half needs: its outcome crosses to the draft, which looks it up in the
    tree (the backup for rows that missed) and sends the next speculation back. It runs when the next
    round is dispatched (or the round is read), so the host's work for the previous round overlaps the
    verify instead of sitting between two verifies."""

    progs: dict
    ctrl: jax.Array
    live: np.ndarray
    active_d: jax.Array
    tree: object
    outcome: jax.Array
    step: int
