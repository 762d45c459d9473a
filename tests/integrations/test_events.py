"""KV events: kvtier tier events become vLLM BlockStored / BlockRemoved, by value."""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvtier.format.chunks import TierEvent, TierEventKind
from kvtier.integrations.vllm.kv_events import REMEMBERED_KEYS, KVEventTranslator

STORED, REMOVED = TierEventKind.STORED, TierEventKind.REMOVED


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_stored_chains_remembered_keys_with_their_tokens() -> None:
    t = KVEventTranslator({"fs": "fs", "shared": "obj"}, chunk_tokens=2)
    t.remember([k(1), k(2), k(3)], [10, 11, 20, 21, 30, 31, 40])
    (event,) = t.translate("host", TierEvent(STORED, (k(1), k(2), k(3))))
    assert event == BlockStored(
        block_hashes=[k(1), k(2), k(3)], parent_block_hash=None, token_ids=[10, 11, 20, 21, 30, 31],
        block_size=2, lora_id=None, medium="CPU", lora_name=None, locality="LOCAL", ownership="host",
    )
    (tail,) = t.translate("fs", TierEvent(STORED, (k(2), k(3))))
    assert (tail.parent_block_hash, tail.token_ids, tail.medium, tail.ownership) == (
        k(1), [20, 21, 30, 31], "STORAGE", "fs"
    )
    (obj,) = t.translate("shared", TierEvent(STORED, (k(3),)))
    assert (obj.medium, obj.locality, obj.ownership) == ("STORAGE", "REMOTE", "shared")


def test_unknown_keys_are_stored_without_tokens_and_break_runs() -> None:
    t = KVEventTranslator({}, chunk_tokens=2)
    t.remember([k(1)], [1, 2])
    events = t.translate("host", TierEvent(STORED, (k(1), k(9))))
    assert [(e.block_hashes, e.token_ids) for e in events] == [([k(1)], [1, 2]), ([k(9)], [])]


def test_removed_is_one_event_per_batch() -> None:
    t = KVEventTranslator({"fs": "fs"}, chunk_tokens=4)
    assert t.translate("fs", TierEvent(REMOVED, (k(1), k(2)))) == [
        BlockRemoved(block_hashes=[k(1), k(2)], medium="STORAGE", locality="LOCAL", ownership="fs")
    ]


def test_memory_is_bounded() -> None:
    t = KVEventTranslator({}, chunk_tokens=1)
    n = REMEMBERED_KEYS + 10
    t.remember([k(i) for i in range(n)], list(range(n)))
    (first,) = t.translate("host", TierEvent(STORED, (k(0),)))
    (last,) = t.translate("host", TierEvent(STORED, (k(n - 1),)))
    assert first.token_ids == [] and last.token_ids == [n - 1]


def test_placement_is_what_the_tier_class_declares() -> None:
    t = KVEventTranslator({"slow": "DelayedMemoryTier", "lost": "NoSuchTier", "r": "redis"}, 1,
                          module_paths={"slow": "tests.tiers.plugin_tier"})
    assert t.placement("slow") == ("CPU", "LOCAL")  # a plugin inherits or sets its own
    assert t.placement("r") == ("CPU", "REMOTE")
    assert t.placement("lost") == ("STORAGE", None)
