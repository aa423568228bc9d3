"""The server under the launcher: process 0 serves HTTP and schedules, process 1 steps the same engine.

``python -m ssd_jax.launch --processes 2 --cpus-per-process 1 serve --method ssd --target-devices 1
--draft-devices 1 ...`` runs the server as two JAX processes, SSD's target on process 0's device and its
draft on process 1's. Every process runs the one engine (:class:`ssd_jax.engine.core.Engine`) and calls
the same compiled programs in the same order (a program on a mesh with no device here is a no-op), so
both must take the same decisions at every step. The engine's decisions depend on what it was given
(sequences, cancellations) and on the rounds' outputs, which both processes read; what reaches process
0 from outside (requests arriving, clients leaving) is therefore applied at step boundaries only and
sent to process 1 before each step, as vLLM's driver broadcasts its scheduler's output:

* a **step** message: its number, the sequences submitted since the last step (prompt ids, sampling
  parameters field by field, sample index, an id), the ids cancelled, and a digest of all of these;
  process 1 checks the number and the digest, applies them, runs the step and answers with an **ack**:
  per field, a digest of its engine's state after the step (the sequence in each slot, the waiting
  queue, the rounds run, the bucket of the round in flight, the last round's K, each row's length and
  last token). Process 0 compares it with its own: the first field that differs stops both processes
  with one line naming the step and the field, instead of a hang or a mismatched collective later;
* an **idle** message every half second while nothing runs, so a dead peer is noticed within a second
  (a send or receive on its closed connection fails) rather than at the coordination service's heartbeat
  timeout;
* **stop** once the HTTP server has shut down (SIGTERM): both processes meet at the shutdown barrier and
  exit 0. Process 1 ignores SIGTERM itself, so in-flight requests finish first.

Before serving, the two agree on the engine's configuration (:func:`engine_config`, field by field). The
messages are JSON objects in typed frames over the processes' authenticated link (:mod:`ssd_jax.parallel.
link`), in program order with the rounds' moves; nothing read is unpickled. Anything malformed ends the
run with one line naming the peer and the step. A dead peer fails every running request with an error,
and the server exits non-zero (process 1 exits when its connection to process 0 closes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from ssd_jax.engine.core import Sequence
from ssd_jax.sampling.filters import SamplingParams

#: seconds between idle messages (a dead peer is noticed within about this)
IDLE_S = 0.5

#: the sampling parameters as they cross, field by field: name -> the JSON types it may have
SAMPLING_FIELDS = {
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "seed": (int,),
    "max_new_tokens": (int,),
    "stop": (list,),
    "ignore_eos": (bool,),
    "n": (int,),
    "min_tokens": (int,),
    "logprobs": (int, type(None)),
}


class LockstepError(RuntimeError):
    """The two processes disagree (a step, its contents, the state after it, or the configuration)."""


def digest(obj) -> str:
    """A short digest of a JSON-able value (canonical: sorted keys, no spaces)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def sampling_fields(sp: SamplingParams) -> dict:
    return {name: list(sp.stop) if name == "stop" else getattr(sp, name) for name in SAMPLING_FIELDS}


def _typed(value, types: tuple) -> bool:
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def sampling_from(fields) -> SamplingParams:
    """The sampling parameters from their fields: exactly :data:`SAMPLING_FIELDS`, each of its type."""
    if not isinstance(fields, dict) or set(fields) != set(SAMPLING_FIELDS):
        raise ValueError("sampling parameters with missing or unknown fields")
    for name, types in SAMPLING_FIELDS.items():
        if not _typed(fields[name], types):
            raise ValueError(f"sampling field {name!r} of type {type(fields[name]).__name__}")
    if not all(isinstance(s, str) for s in fields["stop"]):
        raise ValueError("sampling field 'stop' holds a non-string")
    return SamplingParams(**{**fields, "stop": tuple(fields["stop"])})


def _arrival(s: Sequence) -> list:
    return [s.uid, [int(t) for t in s.prompt_ids], sampling_fields(s.sampling), s.index]


def step_message(step: int, new: list[Sequence], cancelled: list[Sequence]) -> dict:
    """What process 1 needs of a step's arrivals and cancellations (each sequence named by its ``uid``),
    with the step's number and a digest of both."""
    body = {"new": [_arrival(s) for s in new], "cancel": [s.uid for s in cancelled]}
    return {"step": step, "digest": digest(body), **body}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_step(msg: dict, expected: int) -> tuple[list[Sequence], list[int]]:
    """The arrivals (as new sequences) and cancelled ids of a step message from process 0. A
    :class:`LockstepError` for a step out of order or a digest that does not match what was decoded,
    a ``ValueError`` for anything malformed."""
    if set(msg) != {"step", "digest", "new", "cancel"}:
        raise ValueError(f"a step message with fields {sorted(msg)}")
    if msg["step"] != expected:
        raise LockstepError(f"step {msg['step']!r} arrived where step {expected} was due")
    if not isinstance(msg["new"], list) or not isinstance(msg["cancel"], list):
        raise ValueError("a step message whose arrivals or cancellations are not lists")
    if not all(_int(u) for u in msg["cancel"]):
        raise ValueError("a cancellation that is not a sequence id")
    seqs = []
    for item in msg["new"]:
        if not (isinstance(item, list) and len(item) == 4 and _int(item[0]) and _int(item[3])):
            raise ValueError("an arrival that is not [id, prompt ids, sampling, index]")
        if not isinstance(item[1], list) or not all(_int(t) for t in item[1]):
            raise ValueError(f"arrival {item[0]}: prompt ids that are not integers")
        seqs.append(Sequence(item[1], sampling_from(item[2]), index=item[3], uid=item[0]))
    got = digest({"new": [_arrival(s) for s in seqs], "cancel": msg["cancel"]})
    if got != msg["digest"]:
        raise LockstepError(f"its contents decode to digest {got}, process 0 sent {msg['digest']!r}")
    return seqs, msg["cancel"]


def engine_state(engine) -> dict:
    """Per field, a digest of the decisions an engine has taken so far (compared after every step)."""
    rows = [
        [len(s.row.tokens), int(s.row.tokens[-1]) if s.row.tokens else -1]
        for s in engine.slots
        if s and s.row
    ]
    state = {
        "slots": [s.uid if s is not None else -1 for s in engine.slots],
        "waiting": [s.uid for s in engine.waiting],
        "rounds": engine.rounds,
        "bucket": engine.pending.bucket if engine.pending is not None else None,
        "k": engine.last_k,
        "rows": rows,
    }
    return {name: digest(v) for name, v in state.items()}


def engine_config(engine, spec) -> dict:
    """What both processes' engines must share, field by field (short values as they are, long ones as a
    digest): the method and its buckets, the slots, windows and paging, the planned speculation."""
    fields = {
        "method": type(engine.method).__name__,
        "k_max": engine.method.k_max,
        "max_batch": engine.B,
        "max_len": engine.max_len,
        "windows": list(engine.windows),
        "buckets": list(engine.method.buckets),
        "prefill_chunk": engine.C,
        "paged": list(engine.paged) if engine.paged else None,
        "target": repr(getattr(engine.model, "cfg", None)),
    }
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        plain = isinstance(v, (str, int, float, bool, type(None), tuple, list))
        fields[f"spec.{f.name}"] = repr(v) if plain else repr(getattr(v, "cfg", type(v).__name__))
    return {k: v if len(str(v)) <= 80 else "sha256:" + digest(str(v)) for k, v in fields.items()}


class Channel:
    """Step messages between the two processes over their link (typed JSON frames, numbered, digested).

    Made in both processes at the same point; they first agree on the engine's configuration."""

    def __init__(self, config: dict, link=None):
        if link is None:
            from ssd_jax.parallel.distributed import link as the_link

            link = the_link()
        self.link, self.steps = link, 0
        self.link.agree("the engine configuration", config)

    # --- process 0

    def step(self, new: list[Sequence], cancelled: list[Sequence]) -> None:
        self.steps += 1
        self.link.where = f"step {self.steps}"
        self.link.send_json("step", step_message(self.steps, new, cancelled))

    def stepped(self, engine) -> None:
        """After process 0's step: process 1's ack of the same step must match this engine's state."""
        ack = self.link.recv_json("ack")
        mine = engine_state(engine)
        if ack.get("step") != self.steps or not isinstance(ack.get("state"), dict):
            raise self.link.error(f"a malformed ack ({sorted(ack)[:4]}) where step {self.steps}'s was due")
        for name in mine:
            if ack["state"].get(name) != mine[name]:
                msg = f"process 1 diverged from process 0 at step {self.steps}: {name!r} differs"
                self.link.abort(msg)
                raise LockstepError(msg)

    def idle(self) -> None:
        self.link.send("idle")

    def stop(self) -> None:
        self.link.send("stop")


def follow(engine, channel: Channel) -> None:
    """Process 1's loop: check and apply each step message, run the step and acknowledge it with this
    engine's state, until process 0 says stop. A malformed or mismatched message tells process 0 why and
    raises (:class:`~ssd_jax.parallel.link.WireError` or :class:`LockstepError`, one line)."""
    link, seqs = channel.link, {}
    while True:
        kind, payload = link.recv("step", "idle", "stop")
        if kind == "stop":
            return
        if kind == "idle":
            continue
        channel.steps += 1
        link.where = f"step {channel.steps}"
        try:
            new, cancel = parse_step(_json(payload), channel.steps)
        except (ValueError, LockstepError) as e:
            err = (
                link.error(str(e))
                if isinstance(e, ValueError)
                else LockstepError(f"step {channel.steps}: {e}")
            )
            link.abort(str(err))
            raise err from None
        for s in new:
            seqs[s.uid] = s
        engine.submit(new)
        for n in cancel:
            if n in seqs:
                seqs[n].cancelled = True
        engine.step()
        link.send_json("ack", {"step": channel.steps, "state": engine_state(engine)})
        for n in [n for n, s in seqs.items() if s.finish_reason is not None]:
            del seqs[n]


def _json(payload: bytes) -> dict:
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("a step frame that is not JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("a step frame that is not a JSON object")
    return obj
