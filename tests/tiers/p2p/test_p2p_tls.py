"""Mutual TLS on the p2p data connections, between real tier processes over loopback.

Throwaway certificates are made with the `openssl` command: a fleet CA signing one certificate per
peer, and an outsider CA signing the intruder's. A and B (fleet certificates) load over TLS; a peer
with the right secret but a certificate of another CA, or without TLS, is refused by A's data port
(`auth_refused`) and its loads fail; the lookups still answer (the control channel is ZMQ's,
encrypted only with CURVE). Bad TLS options name the option.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.base import Job, JobKind, LookupResult
from kvtier.tiers.p2p import P2PTier, protocol
from kvtier.tiers.p2p.auth import Secret
from kvtier.tiers.process import TierProcess
from tests.conftest import ROW_BYTES, fill_slot, random_key, settle_lookup, wait_jobs
from tests.tiers.p2p.helpers import FP, SECRET, address, ctx_of, data_address
from tests.tiers.process_helpers import reported_counts

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
             cwd=d)


def _signed(d: Path, ca: str, name: str) -> dict[str, str]:
    """A certificate for `name` signed by `ca`, as the three TLS options (CA: `ca`'s own)."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", cwd=d)
    return {"tls_cert_file": str(d / f"{name}.pem"), "tls_key_file": str(d / f"{name}.key"),
            "tls_ca_file": str(d / f"{ca}.pem")}


def refusals(proc: TierProcess, expected: int, timeout_s: float = 5.0) -> float:
    """`auth_refused` of `proc` once it reached `expected` (the holder counts a refusal just after
    the TLS layer hung up, so the requester may see it first), or when `timeout_s` ran out."""
    deadline = time.monotonic() + timeout_s
    while (seen := reported_counts(proc)[TierCounter.AUTH_REFUSED]) < expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return seen


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "fleet")
    _ca(d, "outsider")
    return {"a": _signed(d, "fleet", "a"), "b": _signed(d, "fleet", "b"),
            "intruder": _signed(d, "outsider", "intruder")}


def test_loads_go_over_tls_and_peers_without_a_fleet_certificate_are_refused(make_peer, certs) -> None:
    a, a_region = make_peer(handshake_timeout_s=0.5, **certs["a"])
    b, b_region = make_peer(peers=[address(a)], **certs["b"])
    outsider, _ = make_peer(peers=[address(a)], **certs["intruder"])
    plain, _ = make_peer(peers=[address(a)], transfer_timeout_s=1.0)  # waits for kvtier's hello
    key = random_key()
    row = fill_slot(ctx_of(a_region), 1)
    a.submit_store(Job(1, JobKind.STORE, (key,), (1,)))
    assert wait_jobs(a, 1)[0].success

    assert settle_lookup(b, [key]) == [LookupResult.HIT]
    b.submit_load(Job(2, JobKind.LOAD, (key,), (3,)))
    assert wait_jobs(b, 1)[0].success
    assert bytes(ctx_of(b_region).slot_view(3)) == row
    for intruder in (outsider, plain):
        assert settle_lookup(intruder, [key]) == [LookupResult.HIT]  # lookups are not TLS
        intruder.submit_load(Job(3, JobKind.LOAD, (key,), (0,)))
        assert not wait_jobs(intruder, 1)[0].success
    assert refusals(a, 2) == 2 and reported_counts(a)[TierCounter.CHUNKS_SERVED] == 1


def test_the_data_port_speaks_only_tls(make_peer, certs) -> None:
    """kvtier's own plain handshake, with the right secret, gets no further than TLS's."""
    a, _ = make_peer(handshake_timeout_s=0.5, **certs["a"])
    conn = socket.create_connection(data_address(a), timeout=5)
    with conn, pytest.raises(OSError):  # the holder's hello never comes; it hangs up
        protocol.set_timeout(conn, 5)
        protocol.client_handshake(conn, Secret(SECRET.encode()), FP, ROW_BYTES)
    assert refusals(a, 1) == 1


@pytest.mark.parametrize(("drop", "key"), [
    ("tls_key_file", "tls_key_file"), ("tls_ca_file", "tls_ca_file"), ("tls_cert_file", "tls_cert_file"),
])
def test_tls_options_come_together(ctx, certs, drop: str, key: str) -> None:
    options = {k: v for k, v in certs["a"].items() if k != drop}
    with pytest.raises(ConfigError) as info:
        P2PTier(ctx, secret=SECRET, **options)
    assert info.value.key == key


def test_unusable_tls_files_name_the_option(ctx, certs, tmp_path: Path) -> None:
    missing = {**certs["a"], "tls_ca_file": str(tmp_path / "none.pem")}
    with pytest.raises(ConfigError) as info:
        P2PTier(ctx, secret=SECRET, **missing)
    assert info.value.key == "tls_ca_file"
    wrong_key = {**certs["a"], "tls_key_file": certs["b"]["tls_key_file"]}
    with pytest.raises(ConfigError) as info:
        P2PTier(ctx, secret=SECRET, **wrong_key)
    assert info.value.key == "tls_cert_file" and "PEM" in str(info.value)
