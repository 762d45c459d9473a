"""The chaos campaign's p2p peer: another instance's host tier, holding the chunks the engine loads
through its p2p tier, whose rows the injectors damage and whose process they kill and restart.

`Peer` is a real p2p tier process (as a serving instance runs one) over a host region of its own,
listening on a fixed loopback port (so a restarted peer is found again at the address the engine's
p2p tier was given). `hold` copies rows into free slots of its region and cascades them to the
tier with a STORE job (the tier computes each row's checksum then, as for a real host tier). `kill`
SIGKILLs the tier process; `restart` starts a new one over the same region, which holds nothing
until rows are held again. Its methods are for one thread (the injectors').

`PeerMedium` is the peer seen as a `media.Medium`: the held keys, each read as the chunk the peer
serves (header + row), and written by overwriting the row in the peer's region, which the peer then
serves with the checksum it computed from the good row: a peer serving bad rows. Only the
corruptions of the row apply (`KINDS`: a flipped bit, another chunk's row, the row cut short and
zero-filled); the peer builds each header itself. The engine's p2p tier refuses such a row but
cannot remove it from the peer, so a refused row is repaired (`repair`: the good row written back,
as the peer's own host tier would re-publish it), and the next corruption of that key is a new one.
`feed` keeps the peer holding what the campaign's fs tier holds (verified copies only).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

from kvtier.bench.chaos.media import Medium
from kvtier.bench.chaos.services import free_ports
from kvtier.host import generations
from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, JobResult
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.process import TierProcess, TierSpec

KINDS = ("payload_flip", "swap", "truncate")
"""The corruptions a peer's row can carry (`corrupt.CORRUPTIONS` names)."""


class Peer:
    """A p2p tier process over a region of `slots` rows, on a fixed port; `start`, `hold`,
    `kill`, `restart`, `close`."""

    def __init__(self, address: str, row_bytes: int, slots: int, layout_fp: str, secret: str,
                 timeout_s: float = 30.0) -> None:
        self.row_bytes, self.slots, self.timeout_s = row_bytes, slots, timeout_s
        self.region = HostRegion.create(row_bytes * slots + generations.nbytes(slots), key="--peer-slots")
        self.address = address
        self._spec = TierSpec(
            tier_name="chaos-peer", type="p2p", module_path=None,
            options={"secret": secret, "listen": self.address}, config_key="peer",
            region_name=self.region.name, shm_dir=os.path.dirname(self.region.path),
            row_bytes=row_bytes, num_slots=slots, layout_fingerprint=layout_fp,
            generations_offset=row_bytes * slots)
        self._proc: TierProcess | None = None
        self._next_job = 0
        self.held: dict[bytes, int] = {}
        """Key -> slot of every row the running process holds."""

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def slot_view(self, slot: int) -> memoryview:
        return self.region.buf[slot * self.row_bytes:(slot + 1) * self.row_bytes]

    def start(self) -> None:
        self.held = {}
        self._proc = TierProcess(self._spec, job_timeout_s=self.timeout_s)
        self._proc.start()

    def hold(self, chunks: list[tuple[bytes, bytes]]) -> None:
        """Hold each (key, row) in a free slot; RuntimeError when the peer did not take them."""
        free = self.slots - len(self.held)
        chunks = [(k, r) for k, r in chunks if k not in self.held][:free]
        if not chunks or self._proc is None:
            return
        first = len(self.held)
        for i, (_, row) in enumerate(chunks):
            self.slot_view(first + i)[:] = row
        keys = tuple(k for k, _ in chunks)
        self._next_job += 1
        slots = tuple(range(first, first + len(keys)))
        self._proc.submit_store(Job(self._next_job, JobKind.STORE, keys, slots))
        results: list[JobResult] = []
        deadline = time.monotonic() + self.timeout_s
        while not results:
            if time.monotonic() > deadline or not self._proc.is_up:
                raise RuntimeError("the p2p peer did not take its rows")
            self._proc.poll()
            results = self._proc.get_finished_jobs()
            time.sleep(0.002)
        self.held.update((k, first + i) for i, k in enumerate(keys) if k in set(results[0].successful_keys))

    def kill(self) -> None:
        """SIGKILL the tier process (its held rows are forgotten with it)."""
        proc, self._proc = self._proc, None
        self.held = {}
        if proc is None:
            return
        if proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.shutdown()

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        """Stop the tier process and free the region. Idempotent."""
        if self._proc is not None:
            self._proc.shutdown()
            self._proc = None
        self.region.close()


class PeerMedium(Medium):
    """The peer's held rows as a `Medium` (see the module docstring)."""

    kinds = KINDS

    def __init__(self, tier: str, layout_fp: str, peer: Peer) -> None:
        super().__init__(tier, layout_fp)
        self.peer = peer
        self._lock = threading.Lock()
        self._good: dict[bytes, bytes] = {}
        """Key -> the good row of every key whose row is damaged now."""

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self.peer.held)

    def read(self, key: bytes) -> bytes | None:
        with self._lock:
            slot = self.peer.held.get(key)
            if slot is None:
                return None
            row = bytes(self.peer.slot_view(slot))
        return chunkfmt.header_bytes(key, self.fp_bytes, row) + row

    def write(self, key: bytes, data: bytes) -> None:
        """Put the row part of `data` in the key's slot, cut or zero-filled to a row's size."""
        size = self.peer.row_bytes
        body = data[chunkfmt.HEADER_BYTES:chunkfmt.HEADER_BYTES + size]
        with self._lock:
            slot = self.peer.held[key]
            view = self.peer.slot_view(slot)
            self._good.setdefault(key, bytes(view))
            view[:] = body + bytes(size - len(body))

    def verify(self, key: bytes) -> bool | None:
        """None when the peer does not hold the key; else whether its row is the good one."""
        with self._lock:
            if key not in self.peer.held:
                return None
            return key not in self._good

    def repair(self, key: bytes) -> None:
        """Write the key's good row back (a no-op when its row is not damaged)."""
        with self._lock:
            good = self._good.pop(key, None)
            slot = self.peer.held.get(key)
            if good is not None and slot is not None:
                self.peer.slot_view(slot)[:] = good

    def feed(self, source: Medium, limit: int = 16) -> int:
        """Hold up to `limit` chunks that `source` holds, valid, and the peer does not; how many."""
        chunks: list[tuple[bytes, bytes]] = []
        stored = source.keys()
        for key in stored:
            if len(chunks) >= limit:
                break
            if key in self.peer.held:
                continue
            data = source.read(key)
            if data is None:
                continue
            head, body = data[:chunkfmt.HEADER_BYTES], data[chunkfmt.HEADER_BYTES:]
            if chunkfmt.verify(head, body, key, self.fp_bytes) is None:
                chunks.append((key, body))
        with self._lock:
            self.peer.hold(chunks)
        return len(chunks)

    def kill_peer(self) -> None:
        """SIGKILL the peer's process: it holds nothing any more, damaged or not."""
        with self._lock:
            self._good = {}
            self.peer.kill()


def peer_address() -> str:
    """A loopback address for a peer to listen on, free a moment ago."""
    return f"tcp://127.0.0.1:{free_ports(1)[0]}"


def tier_options(address: str, secret: str) -> dict[str, Any]:
    """The p2p tier options (beside its `type`) that make an engine load from the peer at `address`."""
    return {"secret": secret, "peers": [address], "reconnect_interval_s": 0.5}
