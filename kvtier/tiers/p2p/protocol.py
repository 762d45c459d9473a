"""Wire formats of the p2p tier, and their validation. Nothing is deserialized beyond fixed fields.

Control (ZMQ, DEALER -> ROUTER): a message is three frames `[head, body, tag]`.
  head: `_HEAD` = magic, op, count, data port, sent-at (unix seconds), request id, sender instance
  id, layout fingerprint, row bytes. tag: HMAC-SHA256 over "ctl" + head + body.
  LOOKUP body: `count` keys of KEY_BYTES. ANSWER body: `count` bytes, 1 where the peer holds the key,
  in the order asked; its data port field is where the peer serves chunks (same host).
  A message is rejected (never answered) when a frame has the wrong size, the tag is wrong, the
  magic, op or count is out of range, or it was sent more than MAX_SKEW_S from now.

Data (plain TCP, one connection per requester thread and peer, persistent):
  server -> client: HELLO = magic, server nonce.
  client -> server: client nonce, layout fingerprint, row bytes, tag("data-c" + both nonces + the
  layout fields). server -> client: status byte (0: accepted, 1: other layout), tag("data-s" + both
  nonces + status), zeros up to BLOCK bytes for HELLO and this answer together. Either side closes
  the connection when the other's tag is wrong.
  Then requests: `_GET` = magic, count (1..MAX_FETCH_KEYS), followed by `count` keys. The server
  answers the keys in order, back to back: per key one status block (STATUS_MISS or STATUS_CHUNK)
  and, for a chunk, the 4 KiB chunk header, the row, and one trailer block: TRAILER_OK, or
  TRAILER_ABORTED when the holder's slot was reused while the row was being sent (the row's bytes
  are void: the requester fails the key and never uses them; the connection stays usable).
  Everything the server sends comes in whole BLOCKs (rows are multiples of the host region's
  ROW_ALIGN), so every row starts at a BLOCK-aligned offset of the stream, and the kernel copies it
  into the page-aligned slot at full speed: rows one byte off that alignment cost the receiving
  process about 1.5-2x the CPU for the same copy (measured on loopback, 2 MiB rows). GET3 names
  this framing (GET2 sent one-byte status and trailer blocks and an unpadded handshake): peers of
  different versions fail the handshake or the first request and close the connection.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from dataclasses import dataclass

from kvtier.tiers.p2p.auth import NONCE_BYTES, TAG_BYTES, Secret, new_nonce

KEY_BYTES = 32
MAX_LOOKUP_KEYS = 1024
"""Most keys in one LOOKUP (the requester splits bigger batches)."""
MAX_FETCH_KEYS = 64
"""Most keys in one data request."""
MAX_SKEW_S = 60.0
"""How far a control message's send time may be from the receiver's clock."""
MAX_CONTROL_BYTES = 4096 + MAX_LOOKUP_KEYS * KEY_BYTES
"""Largest control message (all frames): the ROUTER drops peers that send more."""

OP_LOOKUP = 1
OP_ANSWER = 2
_HEAD = struct.Struct("<8sBxxxIIdQ16s16sQ")
_CTL_MAGIC = b"KVTP2PC1"
_DATA_MAGIC = b"KVTP2PD2"
GET_MAGIC = b"GET3"
BLOCK = 64
"""Every answer to a data request is a multiple of this many bytes."""
_HELLO = struct.Struct(f"<8s{NONCE_BYTES}s")
_CLIENT_AUTH = struct.Struct(f"<{NONCE_BYTES}s16sQ{TAG_BYTES}s")
_SERVER_AUTH = struct.Struct(f"<B{TAG_BYTES}s{BLOCK - _HELLO.size - 1 - TAG_BYTES}x")
_GET = struct.Struct("<4sI")
STATUS_MISS = bytes(BLOCK)
STATUS_CHUNK = b"\x01" + bytes(BLOCK - 1)
TRAILER_ABORTED = bytes(BLOCK)
TRAILER_OK = b"\x01" + bytes(BLOCK - 1)


class AuthError(Exception):
    """The peer does not hold the shared secret."""


class ProtocolError(Exception):
    """A message that breaks the wire format (sizes, magic, counts, layout)."""


class PeerFailure(Exception):
    """A failure to log that no library raised (a timeout, a refusal): its message is the detail."""


@dataclass(frozen=True)
class Control:
    """A validated control message."""

    op: int
    count: int
    data_port: int
    request_id: int
    instance_id: bytes
    layout_fp: bytes
    row_bytes: int
    body: bytes

    def keys(self) -> list[bytes]:
        return [self.body[i : i + KEY_BYTES] for i in range(0, len(self.body), KEY_BYTES)]


def encode_control(
    secret: Secret, op: int, request_id: int, instance_id: bytes, layout_fp: bytes, row_bytes: int,
    body: bytes, count: int, data_port: int = 0,
) -> list[bytes]:
    """The three frames of a control message."""
    head = _HEAD.pack(_CTL_MAGIC, op, count, data_port, time.time(), request_id, instance_id,
                      layout_fp, row_bytes)
    return [head, body, secret.tag(b"ctl", head, body)]


def decode_control(secret: Secret, frames: list[bytes]) -> Control:
    """Validate a control message; raises AuthError or ProtocolError."""
    if len(frames) != 3:
        raise ProtocolError(f"{len(frames)} frames, expected 3")
    head, body, tag = frames
    if len(head) != _HEAD.size or len(tag) != TAG_BYTES or len(body) > MAX_LOOKUP_KEYS * KEY_BYTES:
        raise ProtocolError("a frame has the wrong size")
    if not secret.check(tag, b"ctl", head, body):
        raise AuthError("wrong control message tag")
    magic, op, count, port, sent_at, req, inst, fp, row_bytes = _HEAD.unpack(head)
    if magic != _CTL_MAGIC:
        raise ProtocolError("wrong magic")
    if not 1 <= count <= MAX_LOOKUP_KEYS:
        raise ProtocolError(f"key count {count} outside 1..{MAX_LOOKUP_KEYS}")
    if op == OP_LOOKUP:
        expected = count * KEY_BYTES
    elif op == OP_ANSWER:
        expected = count
    else:
        raise ProtocolError(f"unknown op {op}")
    if len(body) != expected:
        raise ProtocolError(f"body of {len(body)} bytes for {count} keys")
    if abs(time.time() - sent_at) > MAX_SKEW_S:
        raise ProtocolError("sent too far from now (clock skew or replay)")
    return Control(op, count, port, req, inst, fp, row_bytes, body)


def set_timeout(sock: socket.socket, seconds: float) -> None:
    """Make `sock` blocking, each send or receive call failing (OSError) after `seconds` without
    progress. The timeouts are the kernel's (SO_SNDTIMEO, SO_RCVTIMEO), not Python's poll loop, so a
    whole piece moves in one system call (`recv_exact` waits for all of it with MSG_WAITALL). A TLS
    socket gets Python's timeout instead: OpenSSL retries a read the kernel timed out."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact(sock: socket.socket, out: memoryview) -> None:
    """Fill `out` from `sock`; ConnectionError when the peer closes first."""
    have = 0
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL  # TLS takes no flags
    while have < len(out):
        got = sock.recv_into(out[have:], 0, flags)
        if got == 0:
            raise ConnectionError("peer closed the connection")
        have += got


def recv_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """Fill every buffer of `parts` in order from `sock` (scattered reads, one system call when the
    bytes come in time); ConnectionError when the peer closes first."""
    if isinstance(sock, ssl.SSLSocket):  # no scattered reads through TLS: one buffer at a time
        for part in parts:
            recv_exact(sock, part)
        return
    while parts:
        got = sock.recvmsg_into(parts, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("peer closed the connection")
        parts = _advance(parts, got)


def send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """Send every buffer of `parts` in order (gathered writes: one system call when they fit)."""
    if isinstance(sock, ssl.SSLSocket):  # no gathered writes through TLS: one buffer at a time
        for part in parts:
            sock.sendall(part)
        return
    while parts:
        parts = _advance(parts, sock.sendmsg(parts))


def _advance(parts: list[memoryview], done: int) -> list[memoryview]:
    """`parts` without their first `done` bytes."""
    while parts and done >= len(parts[0]):
        done -= len(parts[0])
        parts = parts[1:]
    if parts and done:
        parts = [parts[0][done:], *parts[1:]]
    return parts


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def server_handshake(sock: socket.socket, secret: Secret, layout_fp: bytes, row_bytes: int) -> bool:
    """Authenticate a requester. Raises AuthError (wrong tag); False for another layout."""
    snonce = new_nonce()
    sock.sendall(_HELLO.pack(_DATA_MAGIC, snonce))
    cnonce, fp, rows, tag = _CLIENT_AUTH.unpack(recv_bytes(sock, _CLIENT_AUTH.size))
    if not secret.check(tag, b"data-c", snonce, cnonce, fp, struct.pack("<Q", rows)):
        raise AuthError("wrong handshake tag")
    status = 0 if (fp, rows) == (layout_fp, row_bytes) else 1
    sock.sendall(_SERVER_AUTH.pack(status, secret.tag(b"data-s", snonce, cnonce, bytes([status]))))
    return status == 0


def client_handshake(sock: socket.socket, secret: Secret, layout_fp: bytes, row_bytes: int) -> None:
    """Authenticate to a holder (and it to us). Raises AuthError or ProtocolError."""
    magic, snonce = _HELLO.unpack(recv_bytes(sock, _HELLO.size))
    if magic != _DATA_MAGIC:
        raise ProtocolError("not a kvtier p2p data server")
    cnonce = new_nonce()
    tag = secret.tag(b"data-c", snonce, cnonce, layout_fp, struct.pack("<Q", row_bytes))
    sock.sendall(_CLIENT_AUTH.pack(cnonce, layout_fp, row_bytes, tag))
    status, stag = _SERVER_AUTH.unpack(recv_bytes(sock, _SERVER_AUTH.size))
    if not secret.check(stag, b"data-s", snonce, cnonce, bytes([status])):
        raise AuthError("the holder's handshake tag is wrong")
    if status != 0:
        raise ProtocolError("the holder serves another layout")


def encode_get(keys: list[bytes]) -> bytes:
    return _GET.pack(GET_MAGIC, len(keys)) + b"".join(keys)


def read_get(sock: socket.socket) -> list[bytes]:
    """Read and validate one data request; ProtocolError for a malformed one."""
    magic, count = _GET.unpack(recv_bytes(sock, _GET.size))
    if magic != GET_MAGIC:
        raise ProtocolError("wrong request magic")
    if not 1 <= count <= MAX_FETCH_KEYS:
        raise ProtocolError(f"request for {count} keys outside 1..{MAX_FETCH_KEYS}")
    body = recv_bytes(sock, count * KEY_BYTES)
    return [body[i : i + KEY_BYTES] for i in range(0, len(body), KEY_BYTES)]
