"""`tenants` in the config: each share checked with the key and value named, the default share,
and the tenant id and metric label of each salt."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.policies.tenants import NO_SALT, OTHER_SALT, TenantShares


def parse(tenants: Any) -> TenantShares | None:
    return KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20, "tenants": tenants}).tenants


def test_absent_tenants_are_off() -> None:
    assert KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20}).tenants is None
    assert parse(None) is None


def test_named_shares_and_the_default() -> None:
    shares = parse({"team-a": 0.5, "team-b": 0.25, "default": 0.1})
    assert shares == TenantShares({"team-a": 0.5, "team-b": 0.25}, 0.1)
    assert shares.labels == ("none", "other", "t1", "t2")  # a salt never becomes a label
    assert shares.shares == (0.1, 0.1, 0.5, 0.25)
    assert shares.caps(100) == [10, 10, 50, 25]
    assert [shares.tenant_of(s) for s in (None, "x", "team-a", "team-b")] == [NO_SALT, OTHER_SALT, 2, 3]
    assert [shares.label_of(s) for s in (None, "x", "team-b")] == ["none", "other", "t2"]


def test_the_default_share_is_half_what_the_named_ones_leave() -> None:
    assert parse({"a": 0.5}) == TenantShares({"a": 0.5}, 0.25)  # `none` and `other` 0.25 each
    assert parse({"a": 0.75, "b": 0.75}) == TenantShares({"a": 0.75, "b": 0.75}, 0.0)  # caps may sum over 1
    assert parse({"default": 0.5}) == TenantShares({}, 0.5)


@pytest.mark.parametrize(
    ("tenants", "key", "value"),
    [
        ({"a": 1.5}, "tenants.a", 1.5),
        ({"a": -0.1}, "tenants.a", -0.1),
        ({"a": "half"}, "tenants.a", "half"),
        ({"a": True}, "tenants.a", True),
        ({"a": float("nan")}, "tenants.a", None),
        ({"default": 2}, "tenants.default", 2),
        ({"other": 0.5}, "tenants.other", 0.5),
        ({"none": 0.5}, "tenants.none", 0.5),
        ({"": 0.5}, "tenants.", ""),
        ({}, "tenants", {}),
        ([0.5], "tenants", [0.5]),
        ("a", "tenants", "a"),
    ],
)
def test_a_bad_tenants_entry_names_its_key_and_value(tenants: Any, key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(tenants)
    assert caught.value.key == key
    if value is not None:
        assert caught.value.value == value
        assert repr(value) in str(caught.value)
    assert key in str(caught.value)


def test_too_many_named_tenants_are_refused() -> None:
    with pytest.raises(ConfigError, match="at most 250 named tenants"):
        parse({f"t{i}": 0.001 for i in range(251)})
