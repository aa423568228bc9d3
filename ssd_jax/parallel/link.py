"""The bytes between the two processes of a two-process run: who may connect, and what may cross.

Process 0 listens where the processes were told to meet (:func:`bind_host`), never on every interface,
and takes as its peer only a connection that answers an HMAC challenge with the run's secret
(:func:`link_secret`); process 1 checks process 0 the same way, so neither side talks to an impostor.
What then crosses is typed frames only (a kind byte, a length, a payload): a move's arrays as a fixed
header (dtype code, shape) and their raw bytes, checked against the arrays the receiver expects, and
small JSON objects (the server's step messages, the start-up agreement). Nothing read from the socket
is unpickled or evaluated, so a peer can at worst end the run, with one line naming it and the step.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct

import numpy as np

log = logging.getLogger(__name__)

#: the run's shared secret (any text; the launcher makes one per run)
SECRET_ENV = "SSD_JAX_LINK_SECRET"
#: a file holding the secret (its first line), for runs across hosts
SECRET_FILE_ENV = "SSD_JAX_LINK_SECRET_FILE"
#: the address process 0's link (and the coordination service) listens on (``--link-host``)
HOST_ENV = "SSD_JAX_LINK_HOST"

_MAGIC = b"SSDJLNK1"
_NONCE = 32
_MAC = 32
#: seconds an accepted connection has to answer the challenge before it is dropped
HANDSHAKE_S = 10.0
#: the largest payload a frame may announce (a prompt of ids as JSON is far below)
MAX_FRAME = 1 << 28

_FRAME = struct.Struct("<BI")  # kind, payload bytes
KINDS = ("hello", "move", "step", "idle", "stop", "ack", "abort")
_KIND_CODE = {k: i + 1 for i, k in enumerate(KINDS)}
#: the dtypes a move may carry, by code (a fixed table: the receiver never interprets a dtype name)
DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
)  # fmt: skip
_LEAF = struct.Struct("<BB")  # dtype code, ndim
_DIM = struct.Struct("<I")
_COUNT = struct.Struct("<H")
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}


class WireError(RuntimeError):
    """The peer broke the protocol (failed the challenge, sent a malformed or unexpected frame)."""


class PeerAborted(RuntimeError):
    """The peer stopped the run and said why (its one line)."""


def link_secret() -> bytes:
    """The run's secret: ``SSD_JAX_LINK_SECRET``, else the first line of ``SSD_JAX_LINK_SECRET_FILE``."""
    from ssd_jax.errors import UserError

    text = os.environ.get(SECRET_ENV, "")
    path = os.environ.get(SECRET_FILE_ENV, "")
    if not text and path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.readline().strip()
        except OSError as e:
            raise UserError(f"cannot read {SECRET_FILE_ENV}={path}: {e.strerror}") from None
    if not text:
        raise UserError(
            f"the two processes' link needs a shared secret: set {SECRET_ENV} (or {SECRET_FILE_ENV}, a file "
            "holding it) to the same random text in every process (python -m ssd_jax.launch sets it)"
        )
    return text.encode()


def bind_host(coordinator_host: str | None) -> str | None:
    """Where process 0 listens: ``SSD_JAX_LINK_HOST`` when given, loopback when the coordinator is on this
    host, else the coordinator's own address (the interface the others were told to reach); None when
    nothing is known (the cluster finds the coordinator: JAX's default then)."""
    explicit = os.environ.get(HOST_ENV, "")
    if explicit:
        return explicit
    if not coordinator_host:
        return None
    host = coordinator_host.strip("[]")
    return "127.0.0.1" if host in LOCAL_HOSTS else host


def _mac(secret: bytes, role: bytes, mine: bytes, theirs: bytes) -> bytes:
    return hmac.new(secret, _MAGIC + role + mine + theirs, hashlib.sha256).digest()


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise RuntimeError("the peer process closed its link (it may have died)")
        got += k
    return bytes(buf)


def challenge(sock: socket.socket, secret: bytes) -> bool:
    """Process 0's side: a fresh nonce out, the peer's nonce and MAC of both back, our MAC of both out.
    False (nothing sent after the nonce) when the answer is wrong."""
    mine = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + mine)
    reply = _read(sock, len(_MAGIC) + _NONCE + _MAC)
    theirs, mac = reply[len(_MAGIC) : -_MAC], reply[-_MAC:]
    if reply[: len(_MAGIC)] != _MAGIC or not hmac.compare_digest(mac, _mac(secret, b"1", mine, theirs)):
        return False
    sock.sendall(_mac(secret, b"0", theirs, mine))
    return True


def answer(sock: socket.socket, secret: bytes, where: str) -> None:
    """Process 1's side of :func:`challenge`; a process 0 that fails it (or drops us) is an error."""
    hello = _read(sock, len(_MAGIC) + _NONCE)
    if hello[: len(_MAGIC)] != _MAGIC:
        raise WireError(f"{where} is not an ssd_jax link")
    theirs, mine = hello[len(_MAGIC) :], secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + mine + _mac(secret, b"1", theirs, mine))
    try:
        mac = _read(sock, _MAC)
    except (RuntimeError, OSError):  # closed or reset: it dropped us
        raise WireError(
            f"process 0 ({where}) refused our answer to its challenge: the processes' {SECRET_ENV} differ"
        ) from None
    if not hmac.compare_digest(mac, _mac(secret, b"0", mine, theirs)):
        raise WireError(f"{where} failed the link's challenge: it does not hold this run's secret")


def accept_peer(srv: socket.socket, secret: bytes, timeout_s: float) -> tuple[socket.socket, str]:
    """The first connection to ``srv`` that answers the challenge, and its address. Any other is logged
    and dropped, and accepting goes on until ``timeout_s``: an impostor cannot take the peer's place."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireError(f"no peer answered the link's challenge within {timeout_s:.0f} s")
        srv.settimeout(left)
        try:
            conn, addr = srv.accept()
        except TimeoutError:
            continue
        where = f"{addr[0]}:{addr[1]}"
        conn.settimeout(HANDSHAKE_S)
        try:
            ok = challenge(conn, secret)
        except (OSError, RuntimeError):  # reset, silent past HANDSHAKE_S, or closed
            ok = False
        if ok:
            conn.settimeout(None)
            return conn, where
        log.warning("link: dropped a connection from %s: it failed the challenge", where)
        conn.close()


def dtype_code(dtype) -> int | None:
    """The wire code of a move's dtype (None: not one a move carries; the collective moves it)."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        return None
    return DTYPES.index(name) if name in DTYPES else None


def encode_arrays(arrays: list[np.ndarray]) -> bytes:
    """A move's payload: the count, each array's dtype code and shape, then their bytes in order."""
    head = [_COUNT.pack(len(arrays))]
    for a in arrays:
        head.append(_LEAF.pack(dtype_code(a.dtype), a.ndim) + b"".join(_DIM.pack(d) for d in a.shape))
    return b"".join(head) + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def decode_arrays(payload: bytes, expected: list[tuple[tuple, object]]) -> list[np.ndarray]:
    """The arrays of a move, each checked against the (shape, dtype) the receiver expects there.
    A ``ValueError`` (one line) for anything else: count, dtype, shape or length."""
    if len(payload) < _COUNT.size or _COUNT.unpack_from(payload)[0] != len(expected):
        raise ValueError(f"a move of {len(expected)} arrays expected, got a malformed header")
    off, sizes = _COUNT.size, []
    for i, (shape, dtype) in enumerate(expected):
        if off + _LEAF.size > len(payload):
            raise ValueError(f"array {i}: the header is cut short")
        code, ndim = _LEAF.unpack_from(payload, off)
        off += _LEAF.size
        dims = struct.unpack_from(f"<{ndim}I", payload, off) if off + 4 * ndim <= len(payload) else None
        off += 4 * ndim
        want = np.dtype(dtype)
        if code != dtype_code(want) or dims != tuple(shape):
            got = DTYPES[code] if code < len(DTYPES) else f"code {code}"
            raise ValueError(
                f"array {i}: {got}{list(dims or ())} where {want.name}{list(shape)} was expected"
            )
        sizes.append(int(np.prod(shape, dtype=np.int64)) * want.itemsize)
    if len(payload) - off != sum(sizes):
        raise ValueError(f"{len(payload) - off} bytes of data where {sum(sizes)} were expected")
    out = []
    for (shape, dtype), n in zip(expected, sizes):
        out.append(np.frombuffer(payload, np.dtype(dtype), count=n // np.dtype(dtype).itemsize, offset=off))
        out[-1] = out[-1].reshape(shape)
        off += n
    return out


def identity() -> dict:
    """What both processes must share: the package's version and, in a git checkout, its commit."""
    import importlib.metadata
    import subprocess

    try:
        version = importlib.metadata.version("ssd_jax")
    except importlib.metadata.PackageNotFoundError:
        version = None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    commit = None
    if os.path.exists(os.path.join(root, ".git")):
        try:
            out = subprocess.run(
                ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            )
            commit = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"version": version, "commit": commit}


class Link:
    """A connected, authenticated socket to the other process, carrying typed frames in program order.

    ``where`` names the point of the run (``step 17`` under the server, ``move 3`` otherwise) for the
    one-line error that a malformed frame ends the run with."""

    def __init__(self, sock: socket.socket, me: int, peer: int, address: str):
        self.sock, self.me, self.peer, self.address = sock, me, peer, address
        self.where = "start-up"
        self.moves = 0
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def error(self, detail: str) -> WireError:
        at = self.where + (f", move {self.moves}" if self.moves else "")
        return WireError(f"process {self.peer} ({self.address}) at {at}: {detail}")

    def send(self, kind: str, payload: bytes = b"") -> None:
        self.sock.sendall(_FRAME.pack(_KIND_CODE[kind], len(payload)) + payload)

    def recv(self, *kinds: str) -> tuple[str, bytes]:
        """The next frame, which must be one of ``kinds``; the peer's ``abort`` raises its reason."""
        code, n = _FRAME.unpack(_read(self.sock, _FRAME.size))
        kind = KINDS[code - 1] if 1 <= code <= len(KINDS) else None
        if kind is None:
            raise self.error(f"unknown frame kind {code}")
        if n > MAX_FRAME:
            raise self.error(f"a {kind} frame of {n} bytes (at most {MAX_FRAME})")
        payload = _read(self.sock, n) if n else b""
        if hasattr(socket, "TCP_QUICKACK"):  # acknowledge now: a delayed ACK would hold the peer's next send
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        if kind == "abort":
            raise PeerAborted(
                f"process {self.peer} stopped the run: {payload.decode('utf-8', 'replace')[:500]}"
            )
        if kind not in kinds:
            raise self.error(f"a {kind} frame where {' or '.join(kinds)} was expected")
        return kind, payload

    def send_json(self, kind: str, obj) -> None:
        self.send(kind, json.dumps(obj, separators=(",", ":")).encode())

    def recv_json(self, kind: str) -> dict:
        payload = self.recv(kind)[1]
        try:
            obj = json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self.error(f"a {kind} frame that is not JSON") from None
        if not isinstance(obj, dict):
            raise self.error(f"a {kind} frame that is not a JSON object")
        return obj

    def abort(self, reason: str) -> None:
        """Tell the peer why the run stops (best effort: it may be gone already)."""
        try:
            self.send("abort", reason.encode()[:500])
        except OSError:
            pass

    def agree(self, what: str, mine: dict, optional: tuple = ()) -> None:
        """Both processes send ``mine`` and compare it with the other's: the first field that differs is
        an error naming it (both sides raise it; neither serves a request on a mismatch). A field in
        ``optional`` is compared only where both know it (not None)."""
        self.send_json("hello", {"what": what, "fields": mine})
        theirs = self.recv_json("hello")
        if theirs.get("what") != what or not isinstance(theirs.get("fields"), dict):
            raise self.error(f"a start-up message for {theirs.get('what')!r} where {what!r} was expected")
        other = theirs["fields"]
        for name in sorted(set(mine) | set(other)):
            unknown = name in optional and None in (mine.get(name), other.get(name))
            if mine.get(name) != other.get(name) and not unknown:
                raise self.error(
                    f"{what} differs in {name!r}: process {self.me} has {mine.get(name)!r}, "
                    f"process {self.peer} has {other.get(name)!r}"
                )

    def send_arrays(self, arrays: list[np.ndarray]) -> None:
        self.moves += 1
        self.send("move", encode_arrays(arrays))

    def recv_arrays(self, expected: list[tuple[tuple, object]]) -> list[np.ndarray]:
        self.moves += 1
        payload = self.recv("move")[1]
        try:
            return decode_arrays(payload, expected)
        except ValueError as e:
            raise self.error(f"malformed move {self.moves}: {e}") from None
