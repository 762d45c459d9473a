"""Optional ZMQ CURVE on the p2p control channel: encrypted lookups, and only key holders connect.

Configured with `curve_secret_key` or `curve_secret_key_file`: the Z85 text (40 characters) of a
CURVE secret key shared by every peer of the fleet, like `secret` (make one with
`python -c "import zmq; print(zmq.curve_keypair()[1].decode())"`). Each peer's control ROUTER is a
CURVE server with that key; each DEALER is a CURVE client with the same key pair, trusting the
server key derived from it. A ZAP handler (`CurveGate`) on the serving side admits only clients
that present the fleet's public key: a peer with another key, or with none, never completes the
ZMQ handshake, so none of its lookups is answered (its loads from us are misses). Refusals that
reach the handler are counted (`auth_refused`) and logged once per cause; a client that used
another server key fails earlier, inside libzmq, and is not seen by the handler.

CURVE protects the control channel only. The data connections (plain TCP) keep the shared-secret
handshake and the chunk checksums, and are not encrypted. The key is never logged or shown in
errors (`Curve` prints as `Curve(***)`).
"""

from __future__ import annotations

import zmq
import zmq.auth.thread
from zmq.utils import z85

from kvtier.errors import ConfigError
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.p2p.protocol import PeerFailure

KEY_CHARS = 40
"""Z85 text of a 32-byte CURVE key."""
ZAP_DOMAIN = "kvtier-p2p"


class Curve:
    """The fleet's CURVE key pair. Immutable; never shown."""

    __slots__ = ("_secret", "public")

    def __init__(self, secret_z85: bytes) -> None:
        self._secret = secret_z85
        self.public = zmq.curve_public(secret_z85)

    def __repr__(self) -> str:
        return "Curve(***)"

    __str__ = __repr__

    def make_server(self, sock: zmq.Socket[bytes]) -> None:
        """Before bind: `sock` accepts only CURVE clients, checked by the context's `CurveGate`."""
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)

    def make_client(self, sock: zmq.Socket[bytes]) -> None:
        """Before connect: `sock` talks CURVE to servers holding the fleet key."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)


class CurveGate:
    """The ZAP handler of one ZMQ context: admits CURVE clients presenting the fleet's public key."""

    def __init__(self, zctx: zmq.Context[zmq.Socket[bytes]], curve: Curve, book: TierBook,
                 failures: FailureLog) -> None:
        self._public = curve.public
        self._book = book
        self._failures = failures
        self._auth = zmq.auth.thread.ThreadAuthenticator(zctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Called by the authenticator's thread for each CURVE handshake (key in Z85)."""
        if domain == ZAP_DOMAIN and client_key == self._public:
            return True
        self._book.count(TierCounter.AUTH_REFUSED)
        self._failures.failed("auth:curve", PeerFailure("refused a control connection: unknown CURVE key"))
        return False

    def close(self) -> None:
        self._auth.stop()


def load_curve(secret_key: str | None, secret_key_file: str | None) -> Curve | None:
    """The fleet key from `curve_secret_key` or `curve_secret_key_file` (at most one; their kinds
    checked by the tier's option spec); None when neither is set. Raises ConfigError naming the
    option; the value shown is always `***`."""
    if secret_key is not None and secret_key_file is not None:
        raise ConfigError("curve_secret_key", "***",
                          "give at most one of `curve_secret_key` or `curve_secret_key_file`")
    if secret_key is not None:
        name = "curve_secret_key"
        raw = secret_key.strip().encode()
    elif secret_key_file is None:
        return None
    else:
        name = "curve_secret_key_file"
        try:
            with open(secret_key_file, "rb") as f:
                raw = f.read().strip()
        except OSError as e:
            raise ConfigError(name, secret_key_file, f"cannot be read: {e.strerror}") from None
    if not zmq.has("curve"):
        raise ConfigError(name, "***", "this pyzmq's libzmq was built without CURVE support")
    if len(raw) != KEY_CHARS:
        raise ConfigError(name, "***", f"must be {KEY_CHARS} characters of Z85 text (a CURVE secret "
                          "key, e.g. from zmq.curve_keypair())")
    try:
        z85.decode(raw)
        return Curve(raw)
    except (ValueError, KeyError, zmq.ZMQError):
        raise ConfigError(name, "***", "is not valid Z85 text of a CURVE secret key") from None
