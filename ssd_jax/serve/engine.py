"""The server's engine thread: the one engine (:class:`ssd_jax.engine.core.Engine`) driven on a thread of
its own, with a bounded waiting queue.

The HTTP side talks to it through three calls: :meth:`ServingEngine.submit` (queue sequences; refuses
when the queue is full), :meth:`ServingEngine.cancel` (a client went away) and
:meth:`ServingEngine.shutdown`. Each sequence reports through its ``sink``, called on the engine thread
with ``("text", new_text)`` and finally ``("done", Sequence)``.
"""

from __future__ import annotations

import logging
import itertools
import secrets
import threading

from ssd_jax.engine.core import Engine, Sequence
from ssd_jax.serve.lockstep import IDLE_S

log = logging.getLogger(__name__)

__all__ = ["EngineDead", "QueueFull", "Sequence", "ServingEngine", "fresh_seed"]


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


class EngineDead(Exception):
    """The engine thread stopped on an error: no request can be served any more (HTTP 503)."""


def fresh_seed() -> int:
    return secrets.randbits(63)


class ServingEngine:
    """An :class:`Engine` behind a lock, stepped by one thread while anything is running or waiting.

    Submissions and cancellations are staged and reach the engine at step boundaries only, so a step
    sees the same sequences however requests race with it; under the launcher (``channel`` set) each
    step's arrivals and cancellations are sent to process 1 before the step (:mod:`.lockstep`).
    ``on_dead``: called once on the engine thread after it failed and every request was ended."""

    def __init__(self, engine: Engine, *, max_waiting: int = 64, channel=None, on_dead=None):
        self.engine, self.max_waiting = engine, max_waiting
        self.model, self.max_len, self.extra_slots = engine.model, engine.max_len, engine.extra_slots
        self.windows, self.metrics = engine.windows, engine.metrics
        self.channel, self.on_dead = channel, on_dead
        self._cv = threading.Condition()
        self._stop = False
        self._staged: list[Sequence] = []  # submitted, not yet in the engine
        self._cancels: list[Sequence] = []  # cancelled, not yet marked
        self._uids = itertools.count()
        self.error: str | None = None  # set when the engine thread failed: one line
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> int:
        return self.engine.running

    @property
    def waiting(self):
        return list(self.engine.waiting) + self._staged

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        self.engine.check_fits(n_prompt, max_tokens)

    def submit(self, seqs: list[Sequence]) -> None:
        with self._cv:
            if self.error is not None:
                raise EngineDead(f"the engine failed: {self.error}")
            if self._stop:
                raise QueueFull("the server is shutting down")
            if len(self.engine.waiting) + len(self._staged) + len(seqs) > self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} sequences)")
            for s in seqs:
                self.engine.check_fits(len(s.prompt_ids), s.sampling.max_new_tokens)
                s.uid = next(self._uids)
            self._staged.extend(seqs)
            self._cv.notify()

    def cancel(self, seqs: list[Sequence]) -> None:
        """Cancel sequences at the next step: a waiting one never starts, a running one frees its slot."""
        with self._cv:
            self._cancels.extend(seqs)
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ssd_jax-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, cancel what is left, and join the loop."""
        with self._cv:
            self._stop = True
            self._cancels.extend(list(self.engine.waiting) + [s for s in self.engine.slots if s is not None])
            self._cancels.extend(self._staged)
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(self.engine.running)
            self.metrics.waiting.set(len(self.engine.waiting) + len(self._staged))

    def _boundary(self) -> tuple[list[Sequence], list[Sequence]]:
        """Under the lock: the staged sequences into the engine, the staged cancellations marked; what
        process 1 needs of both (the arrivals, the cancelled sequences still unfinished)."""
        new, self._staged = self._staged, []
        cancels, self._cancels = self._cancels, []
        self.engine.waiting.extend(new)
        for s in cancels:
            s.cancelled = True
        return new, [s for s in cancels if s.finish_reason is None]

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while (
                        not self._stop and not self.engine.busy() and not self._staged and not self._cancels
                    ):
                        self._cv.wait(IDLE_S)
                        if self.channel is not None and not self._staged and not self._cancels:
                            self.channel.idle()  # a dead peer fails this within a second
                    new, cancelled = self._boundary()
                    if self._stop and not self.engine.busy():
                        return
                if self.channel is not None:
                    self.channel.step(new, cancelled)
                self.engine.step()  # outside the lock: submit and cancel never wait for a round
                if self.channel is not None:  # process 1 took the same decisions, or both stop here
                    self.channel.stepped(self.engine)
                self._gauges()
        except Exception as e:  # noqa: BLE001 - a device or host failure: fail every request, stay up for /health
            self._die(e)

    def _die(self, e: Exception) -> None:
        """Every sequence in a slot or waiting ends with ``error``; later submissions get :class:`EngineDead`."""
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        log.error(f"[serve] engine failed: {msg}")
        with self._cv:
            self.error, self._stop = msg, True
            self.engine.waiting.extend(self._staged)
            self._staged = []
            self.engine.fail_all("error")
            self._gauges()
        if self.on_dead is not None:
            self.on_dead()
