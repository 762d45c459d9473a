"""The p2p tier's shared secret: loading it, and the HMAC-SHA256 tags that prove a peer holds it.

Peers never send the secret. Control messages carry an HMAC over their whole content; a data
connection starts with a mutual challenge-response (each side proves the secret over both sides'
fresh nonces), so a recorded handshake cannot be replayed. Tags are compared in constant time.

`Secret` keeps the bytes out of `repr`/`str`, so a log line or an error message that formats it shows
`Secret(***)`, never the value.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from kvtier.errors import ConfigError

MIN_SECRET_BYTES = 16
TAG_BYTES = 32
NONCE_BYTES = 16


class Secret:
    """A shared secret of at least MIN_SECRET_BYTES bytes. Immutable; never shown."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"a p2p secret must be at least {MIN_SECRET_BYTES} bytes")
        self._key = key

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__

    def tag(self, *parts: bytes | memoryview) -> bytes:
        """HMAC-SHA256 over the concatenation of `parts`."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def check(self, tag: bytes | memoryview, *parts: bytes | memoryview) -> bool:
        """Whether `tag` is the HMAC of `parts` (constant-time comparison)."""
        return len(tag) == TAG_BYTES and hmac.compare_digest(bytes(tag), self.tag(*parts))


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def load_secret(secret: str | None, secret_file: str | None) -> Secret:
    """The secret from exactly one of the `secret` (a string) or `secret_file` (a path) options,
    whose kinds the tier's option spec has checked.

    Raises ConfigError naming the option; the value shown in the error is always `***`.
    """
    if secret is not None and secret_file is None:
        raw, key = secret.encode(), "secret"
    elif secret_file is not None and secret is None:
        try:
            with open(secret_file, "rb") as f:
                raw = f.read().strip()
        except OSError as e:
            raise ConfigError("secret_file", secret_file, f"cannot be read: {e.strerror}") from None
        key = "secret_file"
    else:
        raise ConfigError("secret", "***" if secret is not None else None,
                          "give exactly one of `secret` or `secret_file` (peers must authenticate)")
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(key, "***", f"the secret must be at least {MIN_SECRET_BYTES} bytes")
    return Secret(raw)
