"""Optional mutual TLS on the p2p data connections: encrypted rows, and only certificate holders.

Configured with `tls_cert_file`, `tls_key_file` and `tls_ca_file` (all three, or none): each peer
presents its certificate (PEM, with its private key) and accepts only a peer whose certificate the
fleet's CA (PEM) signed, in both directions: the serving side requires a client certificate, the
asking side verifies the holder's. Peers are found by address, not by name, so host names are not
checked: the CA is the identity of the fleet. TLS 1.2 at least.

TLS wraps the data connection before kvtier's own shared-secret handshake, which still runs inside
it: a peer needs both the certificate and the secret. The control channel (ZMQ lookups) is not
TLS; `curve_secret_key` encrypts it. Key material is never logged or shown in errors.

A TLS socket moves bytes through OpenSSL's buffers: `protocol`'s scattered reads and gathered
writes fall back to one buffer per call on it (`protocol.recv_parts`, `send_parts`).
"""

from __future__ import annotations

import os
import socket
import ssl

from kvtier.errors import ConfigError

OPTION_NAMES = ("tls_cert_file", "tls_key_file", "tls_ca_file")


class Tls:
    """The fleet's TLS contexts, both sides. Never shows the files' contents."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str) -> None:
        self.server = self._context(ssl.PROTOCOL_TLS_SERVER, cert_file, key_file, ca_file)
        self.client = self._context(ssl.PROTOCOL_TLS_CLIENT, cert_file, key_file, ca_file)
        self.client.check_hostname = False  # peers are addresses; the CA decides who belongs

    @staticmethod
    def _context(protocol: int, cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(cert_file, key_file)
        ctx.load_verify_locations(cafile=ca_file)
        return ctx

    def __repr__(self) -> str:
        return "Tls(***)"

    def wrap_server(self, conn: socket.socket) -> ssl.SSLSocket:
        """The accepted `conn` as a TLS socket whose handshake the caller runs (`do_handshake`,
        under its own deadline; it raises ssl.SSLError on a peer without a certificate the CA
        signed)."""
        return self.server.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)

    def wrap_client(self, conn: socket.socket, timeout_s: float) -> ssl.SSLSocket:
        """The connected `conn`, TLS handshake done within `timeout_s` (raises ssl.SSLError on a
        holder without a certificate the CA signed, TimeoutError when it stays silent)."""
        conn.settimeout(timeout_s)
        return self.client.wrap_socket(conn, server_hostname=None)


def load_tls(cert_file: str | None, key_file: str | None, ca_file: str | None) -> Tls | None:
    """The TLS contexts for these options (all three set, or none: None). Raises ConfigError naming
    the option that is missing or cannot be used."""
    given = dict(zip(OPTION_NAMES, (cert_file, key_file, ca_file), strict=True))
    if all(v is None for v in given.values()):
        return None
    for name, path in given.items():
        if path is None:
            others = [n for n in OPTION_NAMES if n != name]
            raise ConfigError(name, None, f"must be set with {' and '.join(others)} (mutual TLS)")
        if not os.access(path, os.R_OK):
            raise ConfigError(name, path, "must be a readable PEM file")
    try:
        return Tls(str(cert_file), str(key_file), str(ca_file))
    except ssl.SSLError as e:
        raise ConfigError("tls_cert_file", cert_file, "with tls_key_file and tls_ca_file, must "
                          f"load as a PEM certificate, its key and a CA ({e.reason})") from None
