"""A real Redis/Valkey Cluster of three masters, for tests and benchmarks: the chaos campaign's
(`kvtier.bench.chaos.valkey_cluster`: start, readiness, `kill(n)` then `restart(n)` empty), in a
temp directory, each node also on a unix socket, with slot migration for the tier's redirect tests.

`move_slot` migrates a slot and its keys to another node as `valkey-cli --cluster reshard` does
(SETSLOT IMPORTING / MIGRATING, MIGRATE, SETSLOT NODE).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import redis

from kvtier.bench.chaos import valkey_cluster
from kvtier.bench.chaos.valkey_cluster import SLOTS, cluster_binary


class Cluster(valkey_cluster.Cluster):
    """Three master nodes, slots split in thirds, no replicas, under a fresh temp directory."""

    def __init__(self, nodes: int = 3) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="kvtier-cluster-")), nodes)
        for node in self.nodes:
            node.extra = ("--unixsocket", str(node.root / "redis.sock"), "--unixsocketperm", "700")

    def unix_url(self, n: int) -> str:
        return f"unix://{self.nodes[n].root / 'redis.sock'}"

    def client(self, n: int) -> redis.Redis:
        client: redis.Redis = self.nodes[n].client()
        return client

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

    def stop(self) -> None:
        """SIGKILL every node and remove the directory. Idempotent."""
        super().stop()
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster() -> Cluster:
    """A started three-master cluster; the caller stops it. FileNotFoundError when neither
    valkey-server nor redis-server is installed."""
    if cluster_binary() is None:
        raise FileNotFoundError("neither valkey-server nor redis-server is installed")
    cluster = Cluster()
    cluster.start()
    return cluster
