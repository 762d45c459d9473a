"""A fleet key against forged chunks in the real tiers: a real fs directory, the session's redis,
Valkey cluster and SeaweedFS. Whoever can write a tier plants a chunk of a key that a store of the
fleet will name: with a correct unkeyed header and checksum over other bytes, or MACed with another
key. With the fleet key each is a counted miss (`bad_chunks{reason="mac"}`), removed, never served,
and an fs store that finds the planted file replaces it; without a key, the unkeyed forgery loads
(what the key is for) and a MACed chunk is refused."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from kvtier.format.chunks import ChunkError
from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, JobResult, SecondaryTier, TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.fleetkey import FleetKey
from kvtier.tiers.fs.tier import FsTier
from kvtier.tiers.obj.tier import ObjTier
from kvtier.tiers.process import TierProcess, TierSpec
from kvtier.tiers.redis.tier import RedisTier
from tests.conftest import LAYOUT_FP, ROW_BYTES, SLOTS, random_key, wait_jobs
from tests.services.redis_cluster import Cluster
from tests.services.s3 import SeaweedServer

FLEET_BYTES = b"the fleet's key: 32 bytes or more"
FLEET = FleetKey.from_bytes(FLEET_BYTES)
OTHER = FleetKey.from_bytes(b"another fleet's key, as long too.")
FP = bytes.fromhex(LAYOUT_FP)
FORGERIES = ["unkeyed", "other_key"]
Plant = Callable[[bytes, bytes], None]
"""Put a value (header + payload) under a chunk key, as whoever can write the tier would."""


def forged(key: bytes, row_bytes: int, how: str) -> tuple[bytes, bytes]:
    """(stored value, its payload): a well-formed chunk of `key` over bytes the fleet never stored."""
    row = os.urandom(row_bytes)
    return chunkfmt.header_bytes(key, FP, row, None if how == "unkeyed" else OTHER) + row, row


def run(tier: SecondaryTier, kind: JobKind, key: bytes, slot: int = 0, job_id: int = 1) -> JobResult:
    (tier.submit_store if kind is JobKind.STORE else tier.submit_load)(Job(job_id, kind, (key,), (slot,)))
    [result] = wait_jobs(tier, 1, timeout_s=30)
    return result


def expect_refused(tier: SecondaryTier, ctx: TierContext, key: bytes) -> None:
    """A load of the forged chunk of `key` fails, is counted as `mac`, and serves nothing."""
    ctx.slot_view(1)[:] = bytes(ctx.row_bytes)
    result = run(tier, JobKind.LOAD, key, slot=1, job_id=2)
    assert not result.success and result.successful_keys == ()
    counts = tier.counts()
    assert counts[ChunkError.MAC] == 1 and counts.bad_chunks == 1


@pytest.fixture
def keyed(ctx: TierContext) -> TierContext:
    return dataclasses.replace(ctx, fleet_key=FLEET)


@pytest.fixture
def built() -> Iterator[list[SecondaryTier]]:
    tiers: list[SecondaryTier] = []
    yield tiers
    for tier in tiers:
        tier.shutdown()


# ---- fs -----------------------------------------------------------------------------------------


def fs_path(root: Path, key: bytes) -> Path:
    return root / LAYOUT_FP / key.hex()[:2] / key.hex()


def plant_file(root: Path, key: bytes, value: bytes) -> None:
    path = fs_path(root, key)
    path.write_bytes(value)
    path.chmod(0o600)


@pytest.mark.parametrize("how", FORGERIES)
def test_fs_a_forged_file_is_a_counted_miss_and_removed(tmp_path, keyed, built, how) -> None:
    tier = FsTier(keyed, root_dir=str(tmp_path))
    built.append(tier)
    key = random_key()
    plant_file(tmp_path, key, forged(key, keyed.row_bytes, how)[0])
    expect_refused(tier, keyed, key)
    assert not fs_path(tmp_path, key).exists()


def test_fs_a_planted_file_is_replaced_by_the_next_store(tmp_path, keyed, built) -> None:
    tier = FsTier(keyed, root_dir=str(tmp_path))
    built.append(tier)
    key = random_key()
    plant_file(tmp_path, key, forged(key, keyed.row_bytes, "unkeyed")[0])
    mine = os.urandom(keyed.row_bytes)
    keyed.slot_view(0)[:] = mine
    assert run(tier, JobKind.STORE, key).success
    assert tier.counts()[ChunkError.MAC] == 1
    stored = fs_path(tmp_path, key).read_bytes()
    head, body = stored[: chunkfmt.HEADER_BYTES], stored[chunkfmt.HEADER_BYTES :]
    assert body == mine and chunkfmt.verify(head, body, key, FP, FLEET) is None
    keyed.slot_view(1)[:] = bytes(keyed.row_bytes)
    assert run(tier, JobKind.LOAD, key, slot=1, job_id=2).success
    assert bytes(keyed.slot_view(1)) == mine
    assert run(tier, JobKind.STORE, key, job_id=3).success  # a good file is kept, not rewritten
    assert tier.counts().bad_chunks == 1


def test_fs_without_a_key_a_planted_file_loads_and_a_keyed_one_is_refused(tmp_path, ctx, built) -> None:
    tier = FsTier(ctx, root_dir=str(tmp_path))
    built.append(tier)
    planted, sealed = random_key(), random_key()
    value, row = forged(planted, ctx.row_bytes, "unkeyed")
    plant_file(tmp_path, planted, value)
    assert run(tier, JobKind.LOAD, planted).success and bytes(ctx.slot_view(0)) == row
    plant_file(tmp_path, sealed, forged(sealed, ctx.row_bytes, "other_key")[0])
    expect_refused(tier, ctx, sealed)


def test_fs_a_tier_process_reads_the_key_file_and_seals_with_it(tmp_path, region: HostRegion, ctx,
                                                                 built) -> None:
    key_file = tmp_path / "fleet.key"
    key_file.write_bytes(FLEET_BYTES)
    key_file.chmod(0o600)
    root = tmp_path / "kv"
    spec = TierSpec(
        tier_name="fs", type="fs", module_path=None, options={"root_dir": str(root)},
        config_key="secondary_tiers[0]", region_name=region.name,
        shm_dir=os.path.dirname(region.path), row_bytes=ROW_BYTES, num_slots=SLOTS,
        layout_fingerprint=LAYOUT_FP, fleet_key_file=str(key_file),
    )
    proc = TierProcess(spec, job_timeout_s=30)
    try:
        proc.start()
        key = random_key()
        ctx.slot_view(0)[:] = row = os.urandom(ROW_BYTES)
        proc.submit_store(Job(1, JobKind.STORE, (key,), (0,)))
        [result] = wait_jobs(proc, 1)
        assert result.success
    finally:
        proc.shutdown()
    stored = fs_path(root, key).read_bytes()
    assert chunkfmt.verify(stored[: chunkfmt.HEADER_BYTES], stored[chunkfmt.HEADER_BYTES :], key, FP,
                           FLEET) is None and stored.endswith(row)
    unkeyed = FsTier(ctx, root_dir=str(root))
    built.append(unkeyed)
    expect_refused(unkeyed, ctx, key)


# ---- redis and the Valkey cluster ---------------------------------------------------------------


def redis_key(options: dict[str, Any], key: bytes) -> str:
    return f"{options['key_prefix']}:{LAYOUT_FP}:{key.hex()}"


@pytest.mark.parametrize("how", FORGERIES)
def test_redis_a_forged_value_is_a_counted_miss_and_removed(keyed, built, redis_tier_options,
                                                            how) -> None:
    import redis

    tier = RedisTier(keyed, **redis_tier_options)
    built.append(tier)
    key = random_key()
    value, row = forged(key, keyed.row_bytes, how)
    client = redis.Redis.from_url(redis_tier_options["url"])
    client.set(redis_key(redis_tier_options, key), value)
    expect_refused(tier, keyed, key)
    assert client.exists(redis_key(redis_tier_options, key)) == 0
    keyed.slot_view(0)[:] = row
    assert run(tier, JobKind.STORE, key, job_id=3).success
    assert run(tier, JobKind.LOAD, key, slot=1, job_id=4).success and bytes(keyed.slot_view(1)) == row


def test_cluster_a_forged_value_is_a_counted_miss(keyed, built, redis_cluster: Cluster,
                                                  cluster_tier_options) -> None:
    tier = RedisTier(keyed, **cluster_tier_options)
    built.append(tier)
    key = random_key()
    value = forged(key, keyed.row_bytes, "unkeyed")[0]
    name = redis_key(cluster_tier_options, key)
    redis_cluster.client(redis_cluster.slot_owners()[key_slot(name.encode())]).set(name, value)
    expect_refused(tier, keyed, key)


# ---- obj (SeaweedFS) ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", FORGERIES)
def test_obj_a_forged_object_is_a_counted_miss_and_removed(keyed, built, s3_server: SeaweedServer,
                                                           s3_tier_options, how) -> None:
    tier = ObjTier(keyed, **s3_tier_options)
    built.append(tier)
    key = random_key()
    value = forged(key, keyed.row_bytes, how)[0]
    client, bucket = s3_server.client(), s3_tier_options["bucket"]
    name = f"kvtier/{LAYOUT_FP}/{key.hex()}"
    client.put_object(Bucket=bucket, Key=name, Body=value)
    expect_refused(tier, keyed, key)
    assert client.list_objects_v2(Bucket=bucket, Prefix=name).get("KeyCount") == 0
