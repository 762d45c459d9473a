"""The p2p tier's data server under hostile clients, on loopback against real tier processes:
idle unauthenticated connections (from one address, and from several) while a peer loads; a
handshake dripped a byte at a time; accepts failing with a real EMFILE (the holder's descriptor
limit lowered from outside). Loopback's 127.0.0.0/8 gives the attackers addresses of their own."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import threading
from collections.abc import Iterator

import pytest

from kvtier.ops.metrics import TierCounter, TierGauge
from kvtier.tiers.base import Job, JobKind, LookupResult
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.tls import Tls
from kvtier.tiers.process import TierProcess
from tests.conftest import fill_slot, random_key, settle_lookup, wait_jobs, wait_until
from tests.tiers.p2p.helpers import address, ctx_of, data_address, store
from tests.tiers.p2p.test_p2p_tls import _ca, _signed
from tests.tiers.process_helpers import reported_counts


def _connect(host: str, port: int) -> socket.socket | None:
    """A connection from `host` that never speaks (None when refused)."""
    sock = socket.socket()
    try:
        sock.bind((host, 0))
        sock.settimeout(1.0)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        return sock
    except OSError:
        sock.close()
        return None


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (what it sent is read and dropped)."""
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@contextlib.contextmanager
def idle_flood(port: int, hosts: list[str], per_host: int) -> Iterator[list[int]]:
    """`per_host` idle connections from each of `hosts`, each reopened as soon as the server closes
    it (checked every 50 ms), until the block ends; yields [connections opened so far]."""
    opened, stop = [0], threading.Event()
    socks: list[socket.socket | None] = [None] * (len(hosts) * per_host)

    def run() -> None:
        while not stop.is_set():
            for i, sock in enumerate(socks):
                if sock is None or _closed(sock):
                    if sock is not None:
                        sock.close()
                    socks[i] = _connect(hosts[i // per_host], port)
                    opened[0] += 1
            stop.wait(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield opened
    finally:
        stop.set()
        thread.join()
        for sock in socks:
            if sock is not None:
                sock.close()


def load(requester: TierProcess, keys: list[bytes], job_id: int) -> bool:
    assert settle_lookup(requester, keys) == [LookupResult.HIT] * len(keys)
    requester.submit_load(Job(job_id, JobKind.LOAD, tuple(keys), tuple(range(len(keys)))))
    [result] = wait_jobs(requester, 1, timeout_s=20)
    return result.success


@pytest.mark.parametrize("hosts, per_host", [(["127.0.0.2"], 80),
                                             ([f"127.0.0.{i}" for i in range(2, 10)], 10)])
def test_idle_connections_do_not_starve_a_peers_loads(make_peer, hosts: list[str], per_host: int) -> None:
    holder, region = make_peer()
    requester, _ = make_peer(peers=[address(holder)], lookup_ttl_s=0.05)
    keys = [random_key() for _ in range(3)]
    for slot in range(3):
        fill_slot(ctx_of(region), slot)
    store(holder, keys, [0, 1, 2])
    with idle_flood(data_address(holder)[1], hosts, per_host) as opened:
        wait_until(lambda: opened[0] >= 2 * len(hosts) * per_host, "the flood to reopen connections")
        for job_id in range(1, 4):
            assert load(requester, keys, job_id), f"load {job_id} failed under the flood"


def drip_until_closed(sock: socket.socket, most: int, every_s: float) -> int | None:
    """Send `sock` one byte every `every_s` until the server closes it: how many were sent then
    (None: still open after `most`)."""
    for sent in range(1, most + 1):
        try:
            sock.sendall(b"x")
            readable, _, _ = select.select([sock], [], [], every_s)
            if readable and sock.recv(1) == b"":  # the server sends nothing until it has our answer
                return sent
        except OSError:
            return sent
    return None


def test_a_handshake_dripped_a_byte_at_a_time_ends_at_its_deadline(make_peer) -> None:
    holder, _ = make_peer(handshake_timeout_s=0.5)
    with socket.create_connection(data_address(holder), timeout=5) as sock:
        assert len(protocol.recv_bytes(sock, protocol._HELLO.size)) == protocol._HELLO.size
        sent = drip_until_closed(sock, protocol._CLIENT_AUTH.size - 1, every_s=0.1)  # never whole
    assert sent is not None and sent < 20, f"drips of 0.1 s before the server closed: {sent}"
    wait_until(lambda: reported_counts(holder)[TierCounter.AUTH_REFUSED] >= 1, "the refusal counted")


@pytest.fixture(scope="module")
def fleet_cert(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A peer's TLS options: its certificate and key, signed by the fleet's CA, and that CA."""
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "fleet")
    return _signed(d, "fleet", "a")


def test_a_handshake_dripped_inside_tls_ends_at_its_deadline(make_peer, fleet_cert) -> None:
    """A client with the fleet's certificate passes TLS, then drips kvtier's own handshake."""
    holder, _ = make_peer(handshake_timeout_s=0.5, **fleet_cert)
    tls = Tls(fleet_cert["tls_cert_file"], fleet_cert["tls_key_file"], fleet_cert["tls_ca_file"])
    with tls.wrap_client(socket.create_connection(data_address(holder), timeout=5), 5) as sock:
        assert len(protocol.recv_bytes(sock, protocol._HELLO.size)) == protocol._HELLO.size
        sent = drip_until_closed(sock, protocol._CLIENT_AUTH.size - 1, every_s=0.1)
    assert sent is not None and sent < 20, f"drips of 0.1 s before the server closed: {sent}"
    wait_until(lambda: reported_counts(holder)[TierCounter.AUTH_REFUSED] >= 1, "the refusal counted")


def test_accepts_failing_with_emfile_back_off_and_resume(make_peer) -> None:
    holder, region = make_peer(handshake_timeout_s=30)
    requester, _ = make_peer(peers=[address(holder)], lookup_ttl_s=0.05)
    keys = [random_key()]
    fill_slot(ctx_of(region), 0)
    store(holder, keys, [0])
    assert load(requester, keys, 1)
    assert holder.pid is not None
    limit = resource.prlimit(holder.pid, resource.RLIMIT_NOFILE)
    fds = len(os.listdir(f"/proc/{holder.pid}/fd"))
    resource.prlimit(holder.pid, resource.RLIMIT_NOFILE, (fds + 2, limit[1]))
    port = data_address(holder)[1]
    idle = [_connect(f"127.0.0.{i}", port) for i in range(2, 8)]  # two are taken, then EMFILE
    try:
        wait_until(lambda: reported_counts(holder)[TierGauge.SERVER_DOWN] == 1,
                   "the holder to report its data server down")
    finally:
        resource.prlimit(holder.pid, resource.RLIMIT_NOFILE, limit)
        for sock in idle:
            if sock is not None:
                sock.close()
    wait_until(lambda: reported_counts(holder)[TierGauge.SERVER_DOWN] == 0,
               "the holder's data server to accept again")
    assert load(requester, keys, 2)
