"""A real Redis/Valkey Cluster of three masters, for tests and benchmarks.

`Cluster` starts three `RedisServer`s (`valkey-server` when installed, else `redis-server`) with
`--cluster-enabled yes`, each with its own directory, ports (client and bus) and nodes.conf; gives
each a third of the 16384 slots (CLUSTER ADDSLOTSRANGE), joins them (CLUSTER MEET) and waits until
every node serves the whole map (a master refuses keys for its first 2 s: a start takes 2-3 s).
`cluster-require-full-coverage no`: while a node is down its slots fail and the other nodes keep
serving theirs. `kill(n)` then `restart(n)`: the node comes back from its nodes.conf with its id and
slots, and empty. `move_slot` migrates a slot and its keys to another node as
`valkey-cli --cluster reshard` does (SETSLOT IMPORTING / MIGRATING, MIGRATE, SETSLOT NODE).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import redis

from tests.services.redis_server import RedisServer, free_port

SLOTS = 16384
READY_TIMEOUT_S = 10.0


def cluster_binary() -> str | None:
    """The server binary a cluster is started from: valkey-server, else redis-server, else None."""
    return shutil.which("valkey-server") or shutil.which("redis-server")


class Cluster:
    """Three master nodes, slots split in thirds, no replicas."""

    def __init__(self, binary: str, nodes: int = 3) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-cluster-"))
        self.nodes: list[RedisServer] = []
        self.bus_ports = [free_port() for _ in range(nodes)]
        for n in range(nodes):
            (self.root / str(n)).mkdir()
            self.nodes.append(RedisServer(
                binary, self.root / str(n), "--cluster-enabled", "yes", "--cluster-node-timeout", "3000",
                "--cluster-require-full-coverage", "no", "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(self.bus_ports[n])))

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{node.port}" for node in self.nodes]

    def unix_url(self, n: int) -> str:
        return self.nodes[n].unix_url

    def client(self, n: int) -> redis.Redis:
        return redis.Redis(port=self.nodes[n].port, socket_timeout=5)

    def start(self) -> None:
        """Start the nodes, split the slots, join them; wait until every node serves every slot."""
        for node in self.nodes:
            node.start()
        share = -(-SLOTS // len(self.nodes))
        for n in range(len(self.nodes)):
            with self.client(n) as c:
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", n + 1)
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", n * share, min(SLOTS, (n + 1) * share) - 1)
        with self.client(0) as c:
            for node, bus_port in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus_port)
        self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every live node says cluster_state:ok and maps all slots to live nodes."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster in {self.root} did not become ready")
            time.sleep(0.02)

    def _ready(self) -> bool:
        for n, node in enumerate(self.nodes):
            if node.proc is None:
                continue
            try:
                with self.client(n) as c:
                    info = c.execute_command("CLUSTER", "INFO")
                    served = sum(int(e[1]) - int(e[0]) + 1 for e in c.execute_command("CLUSTER", "SLOTS"))
                    known = c.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                return False
            text = info.decode() if isinstance(info, bytes) else str(info)
            nodes = known.decode() if isinstance(known, bytes) else str(known)
            if ("cluster_state:ok" not in text or served != SLOTS or "fail" in nodes
                    or "handshake" in nodes or "noaddr" in nodes):
                return False
        return True

    def node_id(self, n: int) -> str:
        with self.client(n) as c:
            return str(c.execute_command("CLUSTER", "MYID").decode())

    def slot_owners(self) -> list[int]:
        """The index of the node serving each slot, as node 0 sees the map now."""
        owners = [-1] * SLOTS
        ports = [node.port for node in self.nodes]
        with self.client(0) as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                first, last = int(start), int(end)
                owners[first : last + 1] = [ports.index(int(master[1]))] * (last + 1 - first)
        return owners

    def move_slot(self, slot: int, src: int, dst: int, finish: bool = True) -> None:
        """Migrate `slot` from node `src` to node `dst`, its keys with it. `finish=False` leaves the
        slot half-migrated (MIGRATING on `src`, IMPORTING on `dst`, no key moved): ASK replies."""
        src_id, dst_id = self.node_id(src), self.node_id(dst)
        with self.client(src) as s, self.client(dst) as d:
            d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            if not finish:
                return
            while keys := s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                s.execute_command("MIGRATE", "127.0.0.1", self.nodes[dst].port, "", 0, 5000, "KEYS", *keys)
            for n in range(len(self.nodes)):
                with self.client(n) as c:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    def kill(self, n: int) -> None:
        self.nodes[n].kill()

    def restart(self, n: int) -> None:
        """Start node `n` again (same port and nodes.conf) and wait until the cluster is whole."""
        self.nodes[n].start()
        self.wait_ready()

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster() -> Cluster:
    """A started three-master cluster; the caller stops it. FileNotFoundError when neither
    valkey-server nor redis-server is installed."""
    binary = cluster_binary()
    if binary is None:
        raise FileNotFoundError("neither valkey-server nor redis-server is installed")
    cluster = Cluster(binary)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster
