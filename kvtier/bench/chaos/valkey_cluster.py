"""The chaos campaign's Redis/Valkey Cluster: three masters its injectors kill and restart one at a
time; also the cluster of the test suite's tier tests (`tests/services/redis_cluster.py`, which adds
slot migration), since an installed kvtier has no tests package.

`Cluster` runs three `valkey-server` (else `redis-server`: `cluster_binary`) nodes with
`--cluster-enabled yes` on free loopback ports, persistence off, `cluster-require-full-coverage no`
(while a node is down the other nodes keep serving their slots) and a 3 s node timeout; it gives node
n the n-th third of the 16384 slots, joins them (CLUSTER MEET) and waits until every live node serves
the whole map (a master refuses keys for its first 2 s: a start takes 2-3 s). The slots never move
during a campaign, so `node_of_slot` is fixed. `kill(n)` SIGKILLs node n; `restart(n)` starts it
again from its nodes.conf (same id, same slots, no data) and waits until the cluster is whole again.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from kvtier.bench.chaos.services import Server, answers_ping, free_ports

SLOTS = 16384
READY_TIMEOUT_S = 30.0


def cluster_binary() -> str | None:
    """The server binary a cluster is started from: valkey-server, else redis-server, else None."""
    return shutil.which("valkey-server") or shutil.which("redis-server")


class ClusterNode(Server):
    """One cluster node: a client port and a bus port, its nodes.conf kept across restarts; `extra`
    server options go after the node's own (a unix socket, say)."""

    name = "cluster-node"

    def __init__(self, binary: str, root: Path, port: int, bus_port: int) -> None:
        super().__init__(root)
        self.binary, self.port, self.bus_port = binary, port, bus_port
        self.extra: tuple[str, ...] = ()

    def _args(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--cluster-enabled", "yes",
                "--cluster-port", str(self.bus_port), "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "3000", "--cluster-require-full-coverage", "no", *self.extra]

    def _ready(self) -> bool:
        return answers_ping(self.port)

    def client(self) -> Any:
        """A client of this node that fails at once while it is down (no retries)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, socket_connect_timeout=1,
                           retry=Retry(NoBackoff(), 0))


class Cluster:
    """Three masters, slots in thirds, no replicas; `start`, `kill(n)`, `restart(n)`, `stop`."""

    def __init__(self, root: Path, nodes: int = 3) -> None:
        binary = cluster_binary()
        if binary is None:
            raise RuntimeError("valkey-server (or redis-server) is not installed")
        self.root = root
        ports = free_ports(2 * nodes)
        self.nodes = [ClusterNode(binary, root / f"node{n}", ports[2 * n], ports[2 * n + 1])
                      for n in range(nodes)]
        self._share = -(-SLOTS // nodes)

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{node.port}" for node in self.nodes]

    @property
    def pids(self) -> list[int]:
        return [node.pid for node in self.nodes if node.pid is not None]

    def node_of_slot(self, slot: int) -> int:
        return slot // self._share

    def start(self, wait: bool = True) -> None:
        """Start the nodes, split the slots, join them; with `wait`, wait until the cluster is whole
        (else call `wait_ready`: the join takes about 2 s, which other start-ups can overlap)."""
        try:
            for node in self.nodes:
                node.start()
            for n, node in enumerate(self.nodes):
                with node.client() as c:
                    c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", n + 1)
                    c.execute_command("CLUSTER", "ADDSLOTSRANGE", n * self._share,
                                      min(SLOTS, (n + 1) * self._share) - 1)
            with self.nodes[0].client() as c:
                for node in self.nodes[1:]:
                    c.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
            if wait:
                self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def kill(self, n: int) -> None:
        self.nodes[n].kill()

    def restart(self, n: int) -> None:
        """Start node `n` again (its port and nodes.conf, no data) and wait until it serves its
        slots again beside the others."""
        self.nodes[n].start()
        self.wait_ready()

    def stop(self) -> None:
        """SIGKILL every node. Idempotent."""
        for node in self.nodes:
            node.kill()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self._serves_all(node) for node in self.nodes if node.proc is not None):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not become whole within {timeout_s} s")
            time.sleep(0.05)

    @staticmethod
    def _serves_all(node: ClusterNode) -> bool:
        import redis

        try:
            with node.client() as c:
                info = c.execute_command("CLUSTER", "INFO")
                served = sum(int(e[1]) - int(e[0]) + 1 for e in c.execute_command("CLUSTER", "SLOTS"))
                known = c.execute_command("CLUSTER", "NODES")
        except redis.RedisError:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        nodes = known.decode() if isinstance(known, bytes) else str(known)
        return ("cluster_state:ok" in text and served == SLOTS and "fail" not in nodes
                and "handshake" not in nodes and "noaddr" not in nodes)
