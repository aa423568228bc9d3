"""The two processes' link (``ssd_jax.parallel.link``) and the server's lockstep over it
(``ssd_jax.serve.lockstep``), in one process over real sockets: where process 0 listens, the HMAC
challenge both ways (an impostor that connects first is dropped, the real peer still links), typed
frames that are never unpickled, moves checked against the arrays expected, and two engines that
disagree stopping both sides with one line naming the step and the field."""

from __future__ import annotations

import collections
import logging
import pickle
import socket
import threading

import numpy as np
import pytest

from ssd_jax.engine.core import Sequence
from ssd_jax.errors import UserError
from ssd_jax.parallel import link as wire
from ssd_jax.sampling.filters import SamplingParams
from ssd_jax.serve import lockstep

SECRET = b"test-secret"


class _Bomb:
    """Unpickling it creates a file: proof that a payload was (or was not) deserialized."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        b = socket.create_connection(srv.getsockname())
        a, _ = srv.accept()
    return a, b


def _pair() -> tuple[wire.Link, wire.Link]:
    """Process 0's and process 1's ends of one TCP connection on loopback (past the challenge)."""
    a, b = _tcp_pair()
    return wire.Link(a, 0, 1, "pair"), wire.Link(b, 1, 0, "pair")


def _in_thread(fn, *args):
    """Run ``fn`` on a thread; the returned dict gets its result or its exception."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


def test_process_0_listens_where_the_processes_were_told(monkeypatch):
    from ssd_jax.parallel.distributed import _coordinator_bind

    monkeypatch.delenv(wire.HOST_ENV, raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert wire.bind_host("localhost") == wire.bind_host("127.0.0.1") == "127.0.0.1"
    assert wire.bind_host("host0.cluster") == "host0.cluster" and wire.bind_host(None) is None
    assert _coordinator_bind("localhost:1234") == "127.0.0.1:1234"
    assert _coordinator_bind("10.0.0.5:99") == "10.0.0.5:99"
    monkeypatch.setenv(wire.HOST_ENV, "10.0.0.7")  # --link-host
    assert wire.bind_host("localhost") == "10.0.0.7" and _coordinator_bind("host0:99") == "10.0.0.7:99"
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "[::]:99")  # the user's own choice stays
    assert _coordinator_bind("host0:99") is None


def test_the_secret_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    monkeypatch.delenv(wire.SECRET_FILE_ENV, raising=False)
    with pytest.raises(UserError, match="SSD_JAX_LINK_SECRET"):
        wire.link_secret()
    (tmp_path / "s").write_text("from-a-file\n")
    monkeypatch.setenv(wire.SECRET_FILE_ENV, str(tmp_path / "s"))
    assert wire.link_secret() == b"from-a-file"
    monkeypatch.setenv(wire.SECRET_ENV, "from-env")
    assert wire.link_secret() == b"from-env"


def test_the_launcher_gives_its_processes_a_fresh_secret_and_a_loopback_coordinator():
    from ssd_jax.cli.launch import process_env

    env = process_env(1, 2, 1, 4321, "cpu", {wire.SECRET_FILE_ENV: "/elsewhere"}, secret="abc")
    assert env[wire.SECRET_ENV] == "abc" and wire.SECRET_FILE_ENV not in env
    assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:4321"


def test_impostors_connecting_first_are_dropped_and_the_peer_still_links(tmp_path, caplog):
    srv = socket.create_server(("127.0.0.1", 0))
    addr = srv.getsockname()
    caplog.set_level(logging.WARNING, logger=wire.__name__)
    accepted = _in_thread(wire.accept_peer, srv, SECRET, 30)
    with socket.create_connection(addr) as bad:  # a pickle instead of an answer
        bad.recv(64)
        bad.sendall(pickle.dumps(_Bomb(tmp_path / "pwned")).ljust(72, b"\0"))
        try:
            assert bad.recv(64) == b""  # dropped: no MAC comes back
        except ConnectionResetError:  # (dropped with the rest of the pickle unread)
            pass
    with socket.create_connection(addr) as wrong, pytest.raises(wire.WireError, match="differ"):
        wire.answer(wrong, b"another secret", "process 0")
    with socket.create_connection(addr):  # connects and leaves
        pass
    real = socket.create_connection(addr)
    wire.answer(real, SECRET, "process 0")
    accepted["thread"].join(10)
    srv.close()
    conn, _ = accepted["result"]
    p0, p1 = wire.Link(conn, 0, 1, "x"), wire.Link(real, 1, 0, "y")
    p1.send_arrays([np.arange(3, dtype=np.int32)])
    assert p0.recv_arrays([((3,), np.int32)])[0].tolist() == [0, 1, 2]
    assert not (tmp_path / "pwned").exists()
    assert sum("failed the challenge" in r.getMessage() for r in caplog.records) == 3


def test_process_1_refuses_a_process_0_without_the_secret():
    import os

    a, b = _tcp_pair()

    def impostor():  # a challenge, then a MAC made up without the secret
        a.sendall(b"SSDJLNK1" + os.urandom(32))
        a.recv(72)
        a.sendall(os.urandom(32))

    done = _in_thread(impostor)
    with pytest.raises(wire.WireError, match="process 0 \\(pair\\) failed the link's challenge"):
        wire.answer(b, SECRET, "process 0 (pair)")
    done["thread"].join(5)
    a, b = _tcp_pair()
    with pytest.raises(wire.WireError, match="is not an ssd_jax link"):
        a.sendall(pickle.dumps(list(range(30))))
        wire.answer(b, SECRET, "process 0 (pair)")


def test_pickled_or_malformed_frames_are_never_deserialized(tmp_path):
    bomb = pickle.dumps(_Bomb(tmp_path / "pwned"))
    p0, p1 = _pair()
    p0.sock.sendall(bomb)  # no frame at all: its first byte is no kind
    with pytest.raises(wire.WireError, match=r"process 0 \(pair\) at start-up: unknown frame kind"):
        p1.recv("step", "idle", "stop")
    p0, p1 = _pair()
    p0.send("step", bomb)  # a well-framed pickle where a step is due: process 1 stops, tells process 0
    ch1 = lockstep.Channel.__new__(lockstep.Channel)
    ch1.link, ch1.steps = p1, 0
    with pytest.raises(wire.WireError, match=r"process 0 \(pair\) at step 1: a step frame that is not JSON"):
        lockstep.follow(_Engine(), ch1)
    with pytest.raises(wire.PeerAborted, match="process 1 stopped the run: .*step 1"):
        p0.recv("ack")
    p0, p1 = _pair()
    p1.send("ack", bomb)  # and a pickle where process 0 waits for an ack
    ch0 = lockstep.Channel.__new__(lockstep.Channel)
    ch0.link, ch0.steps = p0, 1
    with pytest.raises(wire.WireError, match="not JSON"):
        ch0.stepped(_Engine())
    assert not (tmp_path / "pwned").exists()


def test_a_move_is_checked_against_the_arrays_expected():
    import ml_dtypes

    arrays = [np.arange(6, dtype=np.int32).reshape(2, 3), np.ones(2, ml_dtypes.bfloat16), np.array(True)]
    want = [(a.shape, a.dtype) for a in arrays]
    data = wire.encode_arrays(arrays)
    assert all(np.array_equal(x, y) for x, y in zip(wire.decode_arrays(data, want), arrays))
    with pytest.raises(ValueError, match="int32.*float32"):
        wire.decode_arrays(data, [((2, 3), np.float32), *want[1:]])
    with pytest.raises(ValueError, match=r"\[2, 3\] where int32\[3, 2\]"):
        wire.decode_arrays(data, [((3, 2), np.int32), *want[1:]])
    with pytest.raises(ValueError, match="bytes of data"):
        wire.decode_arrays(data[:-1], want)
    with pytest.raises(ValueError, match="malformed header"):
        wire.decode_arrays(data, want[:2])
    assert wire.dtype_code(np.dtype([("a", np.int32)])) is None  # not a move's: the collective moves it
    p0, p1 = _pair()
    p0.send_arrays(arrays[:1])
    with pytest.raises(wire.WireError, match=r"at start-up, move 1: malformed move 1: array 0"):
        p1.recv_arrays([((2, 2), np.int32)])


def test_sampling_parameters_cross_field_by_field():
    import dataclasses

    assert set(lockstep.SAMPLING_FIELDS) == {f.name for f in dataclasses.fields(SamplingParams)}
    sp = SamplingParams(0.7, 5, 0.9, 2**62 + 3, 40, ("\n\n", "END"), True, 1, 3, 4)
    seq = Sequence([5, 6, 7], sp, index=2, uid=11)
    msg = lockstep.step_message(4, [seq], [Sequence([1], SamplingParams(), uid=3)])
    import json

    new, cancel = lockstep.parse_step(json.loads(json.dumps(msg)), 4)
    assert (new[0].sampling, new[0].prompt_ids, new[0].index, new[0].uid, cancel) == (
        sp,
        [5, 6, 7],
        2,
        11,
        [3],
    )
    with pytest.raises(lockstep.LockstepError, match="step 4 arrived where step 5"):
        lockstep.parse_step(msg, 5)
    with pytest.raises(lockstep.LockstepError, match="digest"):
        lockstep.parse_step({**msg, "cancel": [3, 4]}, 4)
    for field, bad in (("top_k", True), ("stop", ["a", 1]), ("seed", "0"), ("extra", 1)):
        fields = {**msg["new"][0][2], field: bad}
        with pytest.raises(ValueError, match="sampling"):
            lockstep.parse_step({**msg, "new": [[11, [5, 6, 7], fields, 2]]}, 4)
    with pytest.raises(ValueError, match="prompt ids"):
        lockstep.parse_step({**msg, "new": [[11, [5, "six"], msg["new"][0][2], 2]]}, 4)


class _Engine:
    """An engine's bookkeeping without a model: a step admits the waiting sequences into free slots
    (``diverge_at``: from that step on, into the last free slot instead of the first)."""

    def __init__(self, diverge_at: int | None = None):
        self.slots: list = [None] * 4
        self.waiting: collections.deque = collections.deque()
        self.rounds, self.pending, self.last_k, self.diverge_at = 0, None, None, diverge_at

    def submit(self, seqs):
        self.waiting.extend(seqs)

    def step(self):
        self.rounds += 1
        while self.waiting and None in self.slots:
            free = [b for b, s in enumerate(self.slots) if s is None]
            late = self.diverge_at is not None and self.rounds >= self.diverge_at
            self.slots[free[-1] if late else free[0]] = self.waiting.popleft()


def _channels(config0: dict, config1: dict):
    p0, p1 = _pair()
    other = _in_thread(lockstep.Channel, config1, p1)
    ch0 = lockstep.Channel(config0, p0)
    other["thread"].join(5)
    return ch0, other


def _drive(ch0, engine, steps: int) -> None:
    for n in range(steps):
        seq = Sequence([1, 2], SamplingParams(), uid=n)
        ch0.step([seq], [])
        engine.waiting.append(seq)  # (the serving engine's boundary puts arrivals in the queue)
        engine.step()
        ch0.stepped(engine)
    ch0.stop()


def test_processes_in_lockstep_serve_until_stopped():
    ch0, made = _channels({"k": 3}, {"k": 3})
    engine1 = _Engine()
    follower = _in_thread(lockstep.follow, engine1, made["result"])
    _drive(ch0, _Engine(), 3)
    follower["thread"].join(5)
    assert "error" not in follower and [s and s.uid for s in engine1.slots] == [0, 1, 2, None]


def test_a_diverging_process_1_stops_both_with_the_step_and_the_field():
    ch0, made = _channels({"k": 3}, {"k": 3})
    follower = _in_thread(lockstep.follow, _Engine(diverge_at=2), made["result"])
    with pytest.raises(lockstep.LockstepError, match="at step 2: 'slots' differs"):
        _drive(ch0, _Engine(), 3)
    follower["thread"].join(5)
    assert isinstance(follower["error"], wire.PeerAborted)
    assert "process 0 stopped the run: process 1 diverged from process 0 at step 2: 'slots'" in str(
        follower["error"]
    )


def test_a_different_configuration_is_an_error_before_serving():
    p0, p1 = _pair()
    other = _in_thread(lockstep.Channel, {"k": 4, "max_batch": 8}, p1)
    with pytest.raises(
        wire.WireError, match="configuration differs in 'k': process 0 has 3, process 1 has 4"
    ):
        lockstep.Channel({"k": 3, "max_batch": 8}, p0)
    other["thread"].join(5)
    assert "'k'" in str(other["error"])
