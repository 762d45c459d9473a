"""KV events: kvtier tier events become vLLM BlockStored / BlockRemoved in vLLM's own hash space,
by value; the fs tier's sidecar names chunks a new translator never saw."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvtier.config import KVTierConfig
from kvtier.engine.events.block_sidecar import BlockSidecar
from kvtier.format.chunks import TierEvent, TierEventKind
from kvtier.integrations.vllm import kv_events
from kvtier.integrations.vllm.kv_events import REMEMBERED_CHUNKS, KVEventTranslator, make_translator

STORED, REMOVED = TierEventKind.STORED, TierEventKind.REMOVED
SPACE = bytes(range(32))


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def h(i: int) -> bytes:
    """vLLM's raw block hash i (32 bytes: the int routers read is its low 64 bits)."""
    return (0xAB << 248 | i).to_bytes(32, "big")


def request(blocks: int, block_size: int, first: int = 0) -> Any:
    tokens = list(range(100, 100 + blocks * block_size + 1))
    return SimpleNamespace(block_hashes=[h(first + b) for b in range(blocks)], all_token_ids=tokens)


def roundtrip(events: list[Any]) -> list[Any]:
    """Events as a consumer on vLLM's own decoder reads them."""
    wire = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
    return list(msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire).events)


def test_stored_names_every_engine_block_with_vllm_int_hashes() -> None:
    t = KVEventTranslator({"fs": "fs", "shared": "obj"}, block_size=2, blocks_per_chunk=2)
    t.remember(request(6, 2), [k(1), k(2), k(3)])
    (event,) = roundtrip(t.translate("host", TierEvent(STORED, (k(1), k(2)))))
    assert event == BlockStored(
        block_hashes=[0, 1, 2, 3], parent_block_hash=None, token_ids=list(range(100, 108)),
        block_size=2, lora_id=None, medium="CPU", lora_name=None, locality="LOCAL",
    )
    (tail,) = roundtrip(t.translate("fs", TierEvent(STORED, (k(3),))))
    assert (tail.block_hashes, tail.parent_block_hash, tail.token_ids) == ([4, 5], 3, list(range(108, 112)))
    assert (tail.medium, tail.locality, tail.ownership) == ("STORAGE", "LOCAL", None)
    runs = t.translate("shared", TierEvent(STORED, (k(1), k(3))))  # not a chain: two runs
    assert [(e.block_hashes, e.parent_block_hash) for e in runs] == [([0, 1], None), ([4, 5], 3)]
    assert {(e.medium, e.locality) for e in runs} == {("STORAGE", "REMOTE")}


def test_an_unfull_chunk_names_only_its_blocks() -> None:
    t = KVEventTranslator({"fs": "fs"}, block_size=2, blocks_per_chunk=4)
    t.remember(request(7, 2), [k(1)])  # one full chunk of 4 blocks, then 3 whole blocks
    t.remember_unfull(request(7, 2), k(9), chunk=1, blocks=3)
    (event,) = roundtrip(t.translate("fs", TierEvent(STORED, (k(9),))))
    assert (event.block_hashes, event.parent_block_hash, event.token_ids) == (
        [4, 5, 6], 3, list(range(108, 114)))
    t.remember_unfull(request(7, 2), k(8), chunk=1, blocks=4)  # vLLM hashed no fourth block
    assert t.translate("fs", TierEvent(STORED, (k(8),))) == []


def test_runs_break_where_chunks_do_not_chain_and_unknown_keys_give_nothing() -> None:
    t = KVEventTranslator({}, block_size=2, blocks_per_chunk=1)
    t.remember(request(3, 2), [k(1), k(2), k(3)])
    events = roundtrip(t.translate("host", TierEvent(STORED, (k(1), k(9), k(3)))))
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [([0], None), ([2], 1)]
    assert t.unnamed == 1
    assert t.translate("host", TierEvent(REMOVED, (k(9),))) == []


def test_removed_is_one_event_for_the_blocks_of_every_chunk() -> None:
    t = KVEventTranslator({"fs": "fs"}, block_size=4, blocks_per_chunk=2)
    t.remember(request(4, 4), [k(1), k(2)])
    assert roundtrip(t.translate("fs", TierEvent(REMOVED, (k(1), k(2))))) == [
        BlockRemoved(block_hashes=[0, 1, 2, 3], medium="STORAGE", locality="LOCAL")
    ]


def test_a_chunk_a_tier_holds_stays_named_past_the_recent_bound() -> None:
    t = KVEventTranslator({"fs": "fs"}, block_size=1, blocks_per_chunk=1)
    n = REMEMBERED_CHUNKS + 10
    keys = [k(i) for i in range(n)]
    t.remember(request(1, 1), keys[:1])
    t.translate("fs", TierEvent(STORED, (k(0),)))
    t.remember(request(n, 1), keys, first=1)
    t.translate("host", TierEvent(STORED, (k(0),)))
    assert t.translate("host", TierEvent(REMOVED, (k(0),)))[0].block_hashes == [0]
    assert t.translate("fs", TierEvent(REMOVED, (k(0),)))[0].block_hashes == [0]
    assert t.translate("host", TierEvent(STORED, (k(1),))) == []  # forgotten: the oldest recent


def wait_resolved(t: KVEventTranslator) -> list[Any]:
    deadline = time.monotonic() + 10
    while not (out := t.take_resolved()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return out


def test_the_fs_sidecar_names_chunks_stored_before_a_restart(tmp_path: Path) -> None:
    config = KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 2,
                                     "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}]})
    before = make_translator(config, 2, "0" * 32)
    before.sidecars["fs"]._space = lambda: SPACE
    before.remember(request(4, 2), [k(1), k(2)])
    stored = before.translate("fs", TierEvent(STORED, (k(1), k(2))))
    before.close()

    after = KVEventTranslator({"fs": "fs"}, 2, 2, sidecars={"fs": BlockSidecar(
        str(tmp_path), "0" * 32, 2, lambda: SPACE)})
    assert after.translate("fs", TierEvent(REMOVED, (k(2),))) == []  # asked of the sidecar
    (removed,) = roundtrip(wait_resolved(after))
    assert removed == BlockRemoved(block_hashes=[2, 3], medium="STORAGE", locality="LOCAL")
    after.translate("fs", TierEvent(STORED, (k(1),)))
    assert roundtrip(wait_resolved(after)) == [stored[0].__class__(
        **{**msgspec.structs.asdict(stored[0]), "block_hashes": [0, 1], "token_ids": [100, 101, 102, 103]})]
    after.close()
    path = Path(after.sidecars["fs"].path(k(1)))
    assert path.exists() and not Path(after.sidecars["fs"].path(k(2))).exists()  # dropped on removal

    path.write_bytes(path.read_bytes()[:-1] + b"\0")  # a corrupt sidecar names nothing, and goes
    other = KVEventTranslator({"fs": "fs"}, 2, 2, sidecars={"fs": BlockSidecar(
        str(tmp_path), "0" * 32, 2, lambda: SPACE)})
    other.translate("fs", TierEvent(REMOVED, (k(1),)))
    deadline = time.monotonic() + 10
    while other.unnamed == 0 and time.monotonic() < deadline:
        other.take_resolved()
        time.sleep(0.01)
    other.close()
    assert other.unnamed == 1 and not path.exists()


def test_a_removal_read_back_after_the_chunk_was_stored_again_is_dropped(tmp_path: Path) -> None:
    sidecar = BlockSidecar(str(tmp_path), "0" * 32, 2, lambda: SPACE)
    t = KVEventTranslator({"fs": "fs"}, 2, 1, sidecars={"fs": sidecar})
    t.remember(request(1, 2), [k(1)])
    t.translate("fs", TierEvent(STORED, (k(1),)))
    fresh = KVEventTranslator({"fs": "fs"}, 2, 1, sidecars={"fs": sidecar})
    fresh.translate("fs", TierEvent(REMOVED, (k(1),)))  # unknown here: asked of the sidecar
    fresh.remember(request(1, 2), [k(1)])
    (again,) = fresh.translate("fs", TierEvent(STORED, (k(1),)))
    sidecar.close()  # its queue done: the answer is in
    assert again.block_hashes == [0] and fresh.take_resolved() == []
    assert Path(sidecar.path(k(1))).exists()


def test_the_longest_held_chunks_are_forgotten_past_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "HELD_CHUNKS", 2)
    t = KVEventTranslator({}, 1, 1)
    t.remember(request(3, 1), [k(0), k(1), k(2)])
    t.translate("host", TierEvent(STORED, (k(0), k(1), k(2))))
    assert t.translate("host", TierEvent(REMOVED, (k(0),))) == [] and t.unnamed == 1
    assert t.translate("host", TierEvent(REMOVED, (k(1),)))[0].block_hashes == [1]


def test_a_block_size_vllm_cannot_view_names_nothing() -> None:
    t = KVEventTranslator({}, block_size=2, blocks_per_chunk=1, hash_block_size=3)
    t.remember(request(2, 2), [k(1)])
    assert t.blocks(k(1)) is None


def test_a_lora_requests_chunks_carry_its_adapter_through_the_sidecar(tmp_path: Path) -> None:
    sidecar = BlockSidecar(str(tmp_path), "0" * 32, 2, lambda: SPACE)
    t = KVEventTranslator({"fs": "fs"}, 2, 1, sidecars={"fs": sidecar})
    req = request(2, 2)
    req.lora_request = SimpleNamespace(name="pirate", adapter_id=3)
    t.remember(req, [k(1), k(2)])
    (stored,) = roundtrip(t.translate("fs", TierEvent(STORED, (k(1), k(2)))))
    assert (stored.lora_name, stored.lora_id, stored.block_hashes) == ("pirate", 3, [0, 1])
    fresh = KVEventTranslator({"fs": "fs"}, 2, 1, sidecars={"fs": sidecar})
    fresh.translate("fs", TierEvent(STORED, (k(2),)))
    sidecar.close()
    (named,) = fresh.take_resolved()
    assert (named.lora_name, named.lora_id, named.parent_block_hash) == ("pirate", 3, 0)


def test_placement_is_what_the_tier_class_declares() -> None:
    t = KVEventTranslator({"slow": "DelayedMemoryTier", "lost": "NoSuchTier", "r": "redis"}, 1, 1,
                          module_paths={"slow": "tests.tiers.plugin_tier"})
    assert t.placement("slow") == ("CPU", "LOCAL")  # a plugin inherits or sets its own
    assert t.placement("r") == ("CPU", "REMOTE")
    assert t.placement("lost") == ("STORAGE", None)


def test_raw_hashes_when_vllm_publishes_raw_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    t = KVEventTranslator({}, block_size=1, blocks_per_chunk=1)
    t.remember(request(1, 1), [k(1)])
    (event,) = t.translate("host", TierEvent(STORED, (k(1),)))
    assert event.block_hashes == [h(0)]
