"""The injectors: a thread that corrupts stored chunks and breaks processes while the engine serves.

Every `corrupt_every_s` it damages `corrupt_batch` stored chunks picked at random among those the
media hold (`media.Medium`) while fewer than `max_open` of a tier's chunks are corrupted, each
with a corruption of `corrupt.CORRUPTIONS` in turn, recorded in the ledger once its bytes are in
place. Every `fault_every_s` it runs the next process fault of
`FAULTS` in turn, each recorded as a window (start, end) with its kind and target:

- `tier_kill`: SIGKILL a tier process (kvtier restarts it with back-off);
- `tier_stop`: SIGSTOP a tier process for `stop_s`, then SIGCONT;
- `redis_restart`: SIGKILL redis-server, start it again (empty: its corruptions are lost);
- `seaweed_restart`: SIGKILL SeaweedFS, start it again on the same data;
- `enospc`: fill the fs tier's filesystem (a small tmpfs) to ENOSPC for `stop_s`, then free it;
- `temp_files`: leave partial temp files in the fs tier's directory, as a killed writer would;
- `cluster_restart`: SIGKILL one node of the Redis/Valkey Cluster (in turn), start it again
  (empty: the corruptions on it are lost) once `stop_s` passed, and wait until the cluster is whole;
- `peer_restart`: SIGKILL the p2p peer's tier process, start it again after `stop_s` (it holds
  nothing until fed again: its corruptions are lost).

A medium with `kinds` takes only those corruptions (a p2p peer: its rows' only); each tick also
feeds the p2p peer what the fs tier holds (`peer.PeerMedium.feed`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.chaos.corrupt import CORRUPTIONS
from kvtier.bench.chaos.ledger import Ledger
from kvtier.bench.chaos.media import ClusterMedium, FsMedium, Medium
from kvtier.bench.chaos.peer import PeerMedium
from kvtier.bench.chaos.services import Redis, Seaweed
from kvtier.bench.chaos.valkey_cluster import Cluster

log = logging.getLogger("kvtier.bench.chaos")
FAULTS = ("tier_kill", "tier_stop", "redis_restart", "seaweed_restart", "enospc", "temp_files",
          "cluster_restart", "peer_restart")
TARGETS = {"redis_restart": "redis", "seaweed_restart": "obj", "enospc": "fs", "temp_files": "fs",
           "cluster_restart": "cluster", "peer_restart": "p2p"}
"""The tier each server fault hits (the campaign names its tiers by these words)."""


@dataclass
class Window:
    """One process fault: what, on which target, from `start` to `end` (monotonic seconds)."""

    kind: str
    target: str
    start: float
    end: float = 0.0
    ok: bool = True
    note: str = ""


@dataclass(frozen=True)
class Pace:
    """How often the injectors act."""

    corrupt_every_s: float
    corrupt_batch: int
    fault_every_s: float
    stop_s: float = 2.0
    faults: tuple[str, ...] = FAULTS
    max_open: float = 1.0
    """At most this fraction of a tier's stored chunks corrupted and unread at once (so that the
    tiers still serve hits between corruptions)."""


@dataclass
class Targets:
    """What the injectors can reach: the media, the tier processes (name -> handle with a `pid`),
    the servers and the fs tier's filesystem."""

    media: list[Medium]
    tiers: Callable[[], dict[str, Any]]
    redis: Redis | None
    seaweed: Seaweed | None
    fs_mount: Path | None
    fs: FsMedium | None
    on_redis_restart: Callable[[], None] = lambda: None
    cluster: Cluster | None = None
    peer: PeerMedium | None = None


@dataclass
class Injectors:
    """The injector thread; `start`, then `stop` (joins) at the end of the run."""

    targets: Targets
    ledger: Ledger
    pace: Pace
    seed: int = 0
    windows: list[Window] = field(default_factory=list)
    failed_injections: Counter[str] = field(default_factory=Counter)
    temps_left: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-chaos", daemon=True)
        self._kinds = list(CORRUPTIONS)
        self._n: Counter[str] = Counter()
        self._node = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def every_fault_ran(self) -> bool:
        """Whether each process fault of the pace has run at least once (its window is closed)."""
        ran = {w.kind for w in list(self.windows)}
        return all(kind in ran for kind in self.pace.faults)

    def _run(self) -> None:
        next_fault = time.monotonic() + self.pace.fault_every_s
        faults = list(self.pace.faults)
        i = 0
        while not self._stop.wait(self.pace.corrupt_every_s):
            self._feed_peer()
            self._corrupt_batch()
            if faults and time.monotonic() >= next_fault:
                self._fault(faults[i % len(faults)])
                i += 1
                next_fault = time.monotonic() + self.pace.fault_every_s

    # -- corruptions ---------------------------------------------------------------------------

    def _feed_peer(self) -> None:
        peer, fs = self.targets.peer, self.targets.fs
        if peer is None or fs is None:
            return
        try:
            peer.feed(fs)
        except Exception as e:  # the peer restarting: fed at a later tick
            log.debug("feeding the p2p peer failed: %s", e)

    def _corrupt_batch(self) -> None:
        for _ in range(self.pace.corrupt_batch):
            medium = self._rng.choice(self.targets.media)
            kinds = getattr(medium, "kinds", self._kinds)
            kind = kinds[self._n[medium.tier] % len(kinds)]
            try:
                if self._corrupt(medium, kind):
                    self._n[medium.tier] += 1
            except Exception as e:  # a server down: no injection this time
                self.failed_injections[f"{medium.tier}:{type(e).__name__}"] += 1

    def _corrupt(self, medium: Medium, kind: str) -> bool:
        if self.ledger.blinded(medium.tier):
            return False
        start = time.monotonic()
        stored = medium.keys()
        if self.ledger.open_count(medium.tier) >= self.pace.max_open * len(stored):
            return False
        keys = self.ledger.free(medium.tier, stored)
        if len(keys) < 2:
            return False
        key, other = self._rng.sample(keys, 2)
        data, other_data = medium.read(key), medium.read(other)
        if data is None or other_data is None:
            return False
        medium.write(key, CORRUPTIONS[kind](data, other_data, self._rng))
        self.ledger.injected(medium.tier, key, kind, start)
        return True

    # -- process faults ------------------------------------------------------------------------

    def _fault(self, kind: str) -> None:
        tiers = self.targets.tiers()
        target = TARGETS.get(kind) or self._rng.choice(sorted(tiers))
        window = Window(kind, target, time.monotonic())
        try:
            getattr(self, f"_{kind}")(tiers, target, window)
        except Exception as e:
            window.ok, window.note = False, f"{type(e).__name__}: {e}"
            log.warning("fault %s on %s failed: %s", kind, target, e)
        window.end = time.monotonic()
        self.windows.append(window)

    def _tier_kill(self, tiers: dict[str, Any], target: str, window: Window) -> None:
        pid = tiers[target].pid
        if pid is None:
            raise RuntimeError("the tier process is down already")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not self._stop.is_set() and time.monotonic() < deadline:
            if tiers[target].is_up and tiers[target].pid != pid:
                return
            time.sleep(0.05)
        window.note = "not back up within 60 s"

    def _tier_stop(self, tiers: dict[str, Any], target: str, window: Window) -> None:
        pid = tiers[target].pid
        if pid is None:
            raise RuntimeError("the tier process is down already")
        os.kill(pid, signal.SIGSTOP)
        try:
            self._stop.wait(self.pace.stop_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _redis_restart(self, tiers: dict[str, Any], target: str, window: Window) -> None:
        server = self.targets.redis
        if server is None:
            raise RuntimeError("no redis in this run")
        server.kill()
        # What the tier found bad before the kill reaches the ledger first (REMOVED events).
        self._stop.wait(self.pace.stop_s)
        self.ledger.lose_tier(target)
        server.start()
        self.targets.on_redis_restart()

    def _seaweed_restart(self, tiers: dict[str, Any], target: str, window: Window) -> None:
        server = self.targets.seaweed
        if server is None:
            raise RuntimeError("no SeaweedFS in this run")
        server.kill()
        self._stop.wait(self.pace.stop_s)
        server.start()

    def _enospc(self, tiers: dict[str, Any], target: str, window: Window) -> None:
        mount = self.targets.fs_mount
        if mount is None:
            raise RuntimeError("the fs tier is not on its own small filesystem")
        filler = mount / "chaos-filler"
        try:
            with open(filler, "wb") as f:
                block = b"\0" * (1 << 20)
                while True:
                    try:
                        f.write(block)
                        f.flush()
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
            window.note = f"filled with {filler.stat().st_size >> 20} MiB"
            self._stop.wait(self.pace.stop_s)
        finally:
            with contextlib.suppress(FileNotFoundError):
                filler.unlink()

    def _temp_files(self, tiers: dict[str, Any], target: str, window: Window) -> None:
        fs = self.targets.fs
        if fs is None:
            raise RuntimeError("no fs tier in this run")
        keys = fs.keys()
        for key in self._rng.sample(keys, min(3, len(keys))):
            data = fs.read(key)
            if data is not None:
                fs.leave_temp(key, data[: len(data) // 2], pid=999_999)
                self.temps_left += 1

    def _cluster_restart(self, tiers: dict[str, Any], target: str, window: Window) -> None:
        cluster = self.targets.cluster
        medium = next((m for m in self.targets.media if m.tier == target), None)
        if cluster is None or not isinstance(medium, ClusterMedium):
            raise RuntimeError("no cluster in this run")
        node, self._node = self._node, (self._node + 1) % len(cluster.nodes)
        window.note = f"node {node}"
        cluster.kill(node)
        # What the tier found bad on the node before the kill reaches the ledger first.
        self._stop.wait(self.pace.stop_s)
        self.ledger.lose_tier(target, lambda key: medium.node_of(key) == node)
        cluster.restart(node)

    def _peer_restart(self, tiers: dict[str, Any], target: str, window: Window) -> None:
        medium = self.targets.peer
        if medium is None:
            raise RuntimeError("no p2p peer in this run")
        self.ledger.blind(target, window.start)
        medium.kill_peer()
        self.ledger.lose_tier(target)
        self._stop.wait(self.pace.stop_s)
        try:
            medium.peer.start()
        finally:
            # Loads submitted until the engine's p2p tier found the new peer say nothing.
            self.ledger.blind(target, window.start, time.monotonic() + 2.0)
