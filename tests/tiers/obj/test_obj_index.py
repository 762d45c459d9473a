"""What the obj tier's key index answers about absent keys, on a clock the test sets (`now` is the
index's argument): a miss is remembered `absent_s` from the lookup that first reported it, then
asked again once; a key proved present meanwhile is a hit at once."""

from __future__ import annotations

from kvtier.tiers.base import LookupResult
from kvtier.tiers.obj.index import ObjIndex

OBJECT_BYTES = 4096
ABSENT_S = 1.5
KEY = bytes(range(32))


def index() -> ObjIndex:
    return ObjIndex(OBJECT_BYTES, None, ABSENT_S)


def test_a_miss_is_kept_absent_s_from_its_first_report_then_asked_again_once() -> None:
    keys = index()
    assert keys.lookup([KEY], now=100.0) == ([LookupResult.RETRY], [KEY])
    assert keys.lookup([KEY], now=100.5) == ([LookupResult.RETRY], [])  # asked already
    keys.answer(KEY, present=False)
    # The absence counts from the lookup that reports it, however long the HEAD took.
    assert keys.lookup([KEY], now=200.0) == ([LookupResult.MISS], [])
    assert keys.lookup([KEY], now=200.0 + ABSENT_S - 0.001) == ([LookupResult.MISS], [])
    assert keys.lookup([KEY], now=200.0 + ABSENT_S) == ([LookupResult.RETRY], [KEY])
    assert keys.lookup([KEY], now=200.0 + ABSENT_S) == ([LookupResult.RETRY], [])
    keys.answer(KEY, present=True)
    assert keys.lookup([KEY], now=200.0 + ABSENT_S) == ([LookupResult.HIT], [])


def test_a_key_proved_present_during_its_absence_is_a_hit_at_once() -> None:
    keys = index()
    keys.lookup([KEY], now=0.0)
    keys.answer(KEY, present=False)
    assert keys.lookup([KEY], now=1.0) == ([LookupResult.MISS], [])
    assert keys.add(KEY)  # a store or a load of this tier proved it present
    assert keys.lookup([KEY], now=1.0) == ([LookupResult.HIT], [])


def test_a_failed_head_is_a_miss_for_absent_s_like_an_absent_key() -> None:
    keys = index()
    keys.lookup([KEY], now=0.0)
    keys.answer(KEY, present=None)
    assert keys.lookup([KEY], now=10.0) == ([LookupResult.MISS], [])
    assert keys.lookup([KEY], now=10.0 + ABSENT_S) == ([LookupResult.RETRY], [KEY])
