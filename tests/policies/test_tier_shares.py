"""Shares of the secondary tiers in `tenants`: a share by tier, the default per tier as for the host
tier, today's numbers meaning the host tier alone, each bad value named by its dotted key, and the
`tenant_shares` admission policy in the chain whenever `tenants` is set."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.policies.tenants import TenantShares
from kvtier.policies.tier_shares import TierShares

TIERS = [{"type": "memory", "name": "mem"}, {"type": "memory", "name": "big"}]


def config(tenants: Any, **extra: Any) -> KVTierConfig:
    return KVTierConfig.from_dict(
        {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": TIERS, "tenants": tenants, **extra})


def test_a_share_by_tier_and_the_default_of_each_tier() -> None:
    shares = config({"a": {"host": 0.5, "mem": 0.25}, "b": 0.25, "c": {"mem": 0.5}}).tenants
    assert shares is not None
    # The host tier as today: `c` gives none there and has the default, half what a and b leave.
    assert shares.shares == (0.125, 0.125, 0.5, 0.25, 0.125)
    assert shares == TenantShares({"a": 0.5, "b": 0.25, "c": 0.125}, 0.125,
                                  {"mem": (0.125, 0.125, 0.25, 0.125, 0.5)})
    assert "big" not in shares.tiers  # no entry names it: no shares there


def test_a_default_by_tier() -> None:
    shares = config({"a": {"big": 0.75}, "default": {"host": 0.2, "big": 0.1}}).tenants
    assert shares == TenantShares({"a": 0.2}, 0.2, {"big": (0.1, 0.1, 0.75)})


def test_a_number_is_a_share_of_the_host_tier_alone_as_before() -> None:
    shares = config({"a": 0.5, "default": 0.2}).tenants
    assert shares == TenantShares({"a": 0.5}, 0.2)
    assert shares is not None and shares.tiers == {}


@pytest.mark.parametrize(
    ("tenants", "key", "value"),
    [
        ({"a": {"mem": 1.5}}, "tenants.a.mem", 1.5),
        ({"a": {"host": -0.1}}, "tenants.a.host", -0.1),
        ({"a": {"mem": "half"}}, "tenants.a.mem", "half"),
        ({"a": {"mem": True}}, "tenants.a.mem", True),
        ({"default": {"big": 2}}, "tenants.default.big", 2),
        ({"a": {"men": 0.5}}, "tenants.a.men", "men"),
        ({"a": {}}, "tenants.a", {}),
    ],
)
def test_a_bad_share_by_tier_names_its_dotted_key_and_value(tenants: Any, key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        config(tenants)
    assert caught.value.key == key and caught.value.value == value
    assert key in str(caught.value) and repr(value) in str(caught.value)


def test_an_unknown_tier_is_refused_with_the_closest_name() -> None:
    with pytest.raises(ConfigError, match="did you mean 'mem'"):
        config({"a": {"men": 0.5}})


def test_tenants_add_the_tenant_shares_policy_once() -> None:
    assert config({"a": 0.5}).admission_classes[-1] is TierShares
    named = config({"a": 0.5}, admission_policy=["tenant_shares", "frequency"]).admission_classes
    assert [c.name for c in named] == ["tenant_shares", "frequency"]
    assert TierShares not in KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20}).admission_classes
