"""The server under the launcher: process 0 serves HTTP and schedules, process 1 steps the same engine.

``python -m ssd_jax.launch --processes 2 --cpus-per-process 1 serve --method ssd --target-devices 1
--draft-devices 1 ...`` runs the server as two JAX processes, SSD's target on process 0's device and its
draft on process 1's. Every process runs the one engine (:class:`ssd_jax.engine.core.Engine`) and calls
the same compiled programs in the same order (a program on a mesh with no device here is a no-op), so
both must take the same decisions at every step. The engine's decisions depend on what it was given
(sequences, cancellations) and on the rounds' outputs, which both processes read; what reaches process
0 from outside (requests arriving, clients leaving) is therefore applied at step boundaries only and
sent to process 1 before each step, as vLLM's driver broadcasts its scheduler's output:

* a **step** message: the sequences submitted since the last step (prompt ids, sampling, sample index,
  an id) and the ids cancelled; process 1 applies them and runs the step;
* an **idle** message every half second while nothing runs, so a dead peer is noticed within a second
  (a send or receive on its closed connection fails) rather than at the coordination service's heartbeat
  timeout;
* **stop** once the HTTP server has shut down (SIGTERM): both processes meet at the shutdown barrier and
  exit 0. Process 1 ignores SIGTERM itself, so in-flight requests finish first.

The messages travel over the same TCP connection as the rounds' moves (:class:`~ssd_jax.parallel.
distributed.Link`), in program order. A dead peer fails every running request with an error, and the
server exits non-zero (process 1 exits when its connection to process 0 closes).
"""

from __future__ import annotations

import pickle
import struct

from ssd_jax.engine.core import Sequence

#: seconds between idle messages (a dead peer is noticed within about this)
IDLE_S = 0.5

_HEADER = struct.Struct("<Q")


class Channel:
    """Step messages between the two processes, over their link (pickled: both ends are this program)."""

    def __init__(self):
        from ssd_jax.parallel.distributed import link

        self.link = link()

    def send(self, kind: str, **body) -> None:
        data = pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL)
        self.link.send(_HEADER.pack(len(data)) + data)

    def recv(self) -> tuple[str, dict]:
        (n,) = _HEADER.unpack(bytes(self.link.recv(_HEADER.size)))
        return pickle.loads(bytes(self.link.recv(n)))


def step_message(new: list[Sequence], cancelled: list[Sequence]) -> dict:
    """What process 1 needs of a step's arrivals and cancellations (each sequence named by its ``uid``)."""
    return {
        "new": [(s.uid, list(s.prompt_ids), s.sampling, s.index) for s in new],
        "cancel": [s.uid for s in cancelled],
    }


def follow(engine, channel: Channel) -> None:
    """Process 1's loop: apply each step message and run the step, until process 0 says stop."""
    seqs: dict[int, Sequence] = {}
    while True:
        kind, body = channel.recv()
        if kind == "stop":
            return
        if kind == "idle":
            continue
        for n, prompt_ids, sampling, index in body["new"]:
            seqs[n] = Sequence(prompt_ids, sampling, index=index)
            engine.submit([seqs[n]])
        for n in body["cancel"]:
            if n in seqs:
                seqs[n].cancelled = True
        engine.step()
        for n in [n for n, s in seqs.items() if s.finish_reason is not None]:
            del seqs[n]
