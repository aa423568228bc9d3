"""What a draft model misses while the target runs AR rounds without it (K = 0 rounds,
:mod:`ssd_jax.decoding.sd_lag`), one part shared by SD and SSD: per row, the tokens the idle draft has not
seen (a device buffer of :data:`~ssd_jax.decoding.sd_lag.LAG_MAX` with a count per row), and the host's
count of AR rounds since the draft last caught up, which bounds every row's count without a read; and
the two programs that use it: the AR round that records what the draft misses, and SD's flush that
catches the draft's cache up (SSD catches up with its own program, which drafts a speculation too)."""

from __future__ import annotations

import numpy as np

from ssd_jax.compile import Compiled
from ssd_jax.decoding import sd_lag


class LagBook:
    """``first_extra``: the tokens a row's first AR round records beyond one. SD's draft leaves the slot of
    ``prev`` unwritten after a fully accepted round, so its first AR round records ``[prev, cur]`` (1);
    SSD's draft has every slot below its length written and records ``cur`` alone (0)."""

    def __init__(self, batch: int, put, first_extra: int):
        self.first_extra, self._put = first_extra, put
        self.lag = put(np.zeros((batch, sd_lag.LAG_MAX), np.int32))  # the tokens, per row
        self.n = put(np.zeros(batch, np.int32))  # how many, per row
        self.rounds = 0  # AR rounds since the last catch-up
        self._reset = Compiled(sd_lag.reset_lag, donate_argnums=(0,), name="reset_lag")

    def full(self) -> bool:
        """Whether one more AR round could overflow a row's buffer (the draft must catch up first)."""
        return self.rounds + 1 + self.first_extra > sd_lag.LAG_MAX

    def recorded(self, lag, n) -> None:
        """An AR round's new buffer and counts."""
        self.lag, self.n = lag, n
        self.rounds += 1

    def caught_up(self, n=None) -> None:
        """The draft caught up (``n``: the counts the catch-up left, when it returns them)."""
        if n is not None:
            self.n = n
        self.rounds = 0

    def admitted(self, rows: np.ndarray) -> None:
        """Rows (a host mask) admitted with their prompt prefilled into the draft: nothing to catch up."""
        self.n = self._reset(self.n, self._put(rows))

    def precompile(self, batch: int) -> None:
        self._reset.precompile(self.n, self._put(np.zeros(batch, bool)))

    def ar_program(self, cfg, mode, window, bucket) -> Compiled:
        """The target's AR round at ``window`` and ``bucket`` for sampling ``mode``, recording in the book."""
        nf = mode.needs_filter and not mode.greedy
        return sd_lag.sd_lag_round_program(
            cfg, nf, mode.greedy, window, bucket, with_prev=self.first_extra > 0
        )

    def ar_args(self, model, tcache, rows, catch, active) -> tuple:
        return model.params, tcache, rows, catch, active, self.lag, self.n

    def ar_round(self, model, tcache, rows, catch, active, mode, window, bucket):
        """One AR round of ``model`` over ``rows`` (the draft idle): returns (out, tcache, (cur, prev, steps),
        catch) and records the tokens the draft missed."""
        out, tcache, state, catch, lag, n = self.ar_program(model.cfg, mode, window, bucket)(
            *self.ar_args(model, tcache, rows, catch, active)
        )
        self.recorded(lag, n)
        return out, tcache, state, catch

    def flush_program(self, draft_cfg, bucket) -> Compiled:
        return sd_lag.draft_flush_program(draft_cfg, sd_lag.LAG_MAX, None, bucket)

    def flush_args(self, draft, dcache) -> tuple:
        return draft.params, dcache, self.lag, self.n

    def flush(self, draft, dcache, bucket):
        """SD's draft caught up: the recorded tokens through ``draft``'s cache (queued on the device; the host
        does not wait). Returns the new cache."""
        dcache, n = self.flush_program(draft.cfg, bucket)(*self.flush_args(draft, dcache))
        self.caught_up(n)
        return dcache
