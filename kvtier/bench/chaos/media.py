"""Direct access to where each secondary tier keeps its chunks, bypassing kvtier: what the
corruption injectors read and damage, and what the final reconciliation inspects.

A `Medium` lists the chunk keys stored under the run's layout fingerprint, reads a stored chunk
(`chunkfmt` header + host row) and writes bytes in its place: fs files under
`root/<fingerprint>/<xx>/<key hex>`, obj objects `<prefix>/<fingerprint>/<key hex>`, redis strings
`<key_prefix>:<fingerprint>:<key hex>`, on one server or on the node of a Redis/Valkey Cluster
that serves the key's slot; a p2p peer's rows are `peer.PeerMedium`. `verify` says whether what is
stored now is a valid chunk of that key (None: absent). Each method may raise what its client
raises (a server is down): the caller counts that as an injection that did not happen.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from kvtier.bench.chaos.valkey_cluster import Cluster
from kvtier.tiers.common import chunkfmt


class Medium(ABC):
    """One tier's storage seen from outside; `tier` is the tier's configured name."""

    tier: str

    def __init__(self, tier: str, layout_fp: str) -> None:
        self.tier = tier
        self.layout_fp = layout_fp
        self.fp_bytes = chunkfmt.fingerprint_bytes(layout_fp)

    @abstractmethod
    def keys(self) -> list[bytes]:
        """The chunk keys stored now (any order)."""

    @abstractmethod
    def read(self, key: bytes) -> bytes | None:
        """The stored bytes of `key`, None when absent."""

    @abstractmethod
    def write(self, key: bytes, data: bytes) -> None:
        """Replace the stored bytes of `key` (whole value, published at once)."""

    def verify(self, key: bytes) -> bool | None:
        """Whether the stored copy of `key` is valid now; None when absent."""
        data = self.read(key)
        if data is None:
            return None
        head, body = data[: chunkfmt.HEADER_BYTES], data[chunkfmt.HEADER_BYTES:]
        return chunkfmt.verify(head, body, key, self.fp_bytes) is None


class FsMedium(Medium):
    def __init__(self, tier: str, layout_fp: str, root: Path) -> None:
        super().__init__(tier, layout_fp)
        self.layout_dir = root / layout_fp

    def path(self, key: bytes) -> Path:
        return self.layout_dir / key.hex()[:2] / key.hex()

    def keys(self) -> list[bytes]:
        out: list[bytes] = []
        if not self.layout_dir.is_dir():
            return out
        for sub in os.scandir(self.layout_dir):
            if sub.is_dir():
                for entry in os.scandir(sub.path):
                    name = entry.name
                    if len(name) == 64 and not name.startswith("."):
                        out.append(bytes.fromhex(name))
        return out

    def read(self, key: bytes) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, key: bytes, data: bytes) -> None:
        path = self.path(key)
        tmp = path.with_name(f".chaos.{path.name}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def leave_temp(self, key: bytes, data: bytes, pid: int) -> Path:
        """A partial temp file as a writer killed mid-write leaves it (the tier's temp naming)."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.{pid}.deadbeef")
        tmp.write_bytes(data)
        return tmp

    def temps(self) -> list[Path]:
        if not self.layout_dir.is_dir():
            return []
        return [p for p in self.layout_dir.rglob("*") if ".tmp." in p.name]


class ObjMedium(Medium):
    def __init__(self, tier: str, layout_fp: str, client: Any, bucket: str, prefix: str) -> None:
        super().__init__(tier, layout_fp)
        self.client = client
        self.bucket = bucket
        self.head = f"{prefix}/{layout_fp}/"

    def keys(self) -> list[bytes]:
        out = []
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.head)
        for page in pages:
            for obj in page.get("Contents", ()):
                out.append(bytes.fromhex(obj["Key"][len(self.head):]))
        return out

    def read(self, key: bytes) -> bytes | None:
        try:
            data: bytes = self.client.get_object(Bucket=self.bucket, Key=self.head + key.hex())["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        return data

    def write(self, key: bytes, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.head + key.hex(), Body=data)


class RedisMedium(Medium):
    def __init__(self, tier: str, layout_fp: str, client: Any, key_prefix: str) -> None:
        super().__init__(tier, layout_fp)
        self.client = client
        self.head = f"{key_prefix}:{layout_fp}:".encode()

    def keys(self) -> list[bytes]:
        return [bytes.fromhex(k[len(self.head):].decode())
                for k in self.client.scan_iter(match=self.head + b"*", count=1000)]

    def read(self, key: bytes) -> bytes | None:
        data: bytes | None = self.client.get(self.head + key.hex().encode())
        return data

    def write(self, key: bytes, data: bytes) -> None:
        self.client.set(self.head + key.hex().encode(), data)


class ClusterMedium(RedisMedium):
    """The redis tier's values on a `cluster.Cluster`: each key on the node serving its slot (the
    slots never move in a campaign). `keys` lists the live nodes' keys only (a node being restarted
    is skipped); reading or writing a key of a dead node raises."""

    def __init__(self, tier: str, layout_fp: str, cluster: Cluster, key_prefix: str) -> None:
        self.cluster = cluster
        self.clients = [node.client() for node in cluster.nodes]
        super().__init__(tier, layout_fp, self.clients[0], key_prefix)

    def node_of(self, key: bytes) -> int:
        from redis.crc import key_slot

        return self.cluster.node_of_slot(key_slot(self.head + key.hex().encode()))

    def keys(self) -> list[bytes]:
        import redis

        out: list[bytes] = []
        for node, client in zip(self.cluster.nodes, self.clients, strict=True):
            if node.proc is None:
                continue
            try:
                out += [bytes.fromhex(k[len(self.head):].decode())
                        for k in client.scan_iter(match=self.head + b"*", count=1000)]
            except redis.RedisError:
                continue
        return out

    def read(self, key: bytes) -> bytes | None:
        data: bytes | None = self.clients[self.node_of(key)].get(self.head + key.hex().encode())
        return data

    def write(self, key: bytes, data: bytes) -> None:
        self.clients[self.node_of(key)].set(self.head + key.hex().encode(), data)
