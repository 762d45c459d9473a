"""Tier option specs: one helper checks kinds, bounds and names, for the config parser and the tiers."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.common.options import HIDDEN, Kind, Option, check_options, count, hidden, seconds
from kvtier.tiers.fs.tier import FsTier
from kvtier.tiers.registry import check_tier_options, declared_options
from tests.tiers.plugin_tier import DelayedMemoryTier, RetryOnceTier

SPEC = (
    Option("root", Kind.TEXT, required=True, test=bool, allowed="must be a directory path"),
    count("threads", 4, 256),
    seconds("ttl_s", 1.0),
    seconds("grace_s", None, low=0),
    Option("token", Kind.TEXT, show=hidden),
    Option("flag", Kind.BOOL, False),
    Option("peers", Kind.TEXTS, ()),
)


def test_defaults_fill_what_is_not_given() -> None:
    assert check_options(SPEC, {"root": "/x", "threads": 2}) == {
        "root": "/x", "threads": 2, "ttl_s": 1.0, "grace_s": None, "token": None, "flag": False,
        "peers": (),
    }


@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("threads", 0, "must be an integer from 1 to 256"),
    ("threads", 2.0, "must be an integer from 1 to 256"),
    ("threads", True, "must be an integer from 1 to 256"),
    ("ttl_s", 0, "must be a positive number of seconds"),
    ("ttl_s", float("nan"), "must be a positive number of seconds"),
    ("ttl_s", None, "must be a positive number of seconds"),
    ("grace_s", -1, "must be null or a non-negative number of seconds"),
    ("root", "", "must be a directory path"),
    ("flag", "yes", "must be true or false"),
    ("peers", "tcp://h:1", "must be a list of strings"),
])
def test_a_bad_value_names_the_dotted_key_and_what_is_allowed(name, value, allowed) -> None:
    with pytest.raises(ConfigError) as e:
        check_options(SPEC, {"root": "/x", name: value}, prefix="secondary_tiers[1].")
    assert (e.value.key, e.value.allowed) == (f"secondary_tiers[1].{name}", allowed)


def test_unknown_and_missing_options_and_secrets() -> None:
    with pytest.raises(ConfigError, match="did you mean 'threads'") as e:
        check_options(SPEC, {"root": "/x", "thread": 2})
    assert e.value.key == "thread"
    with pytest.raises(ConfigError, match="required") as e:
        check_options(SPEC, {})
    assert e.value.key == "root"
    with pytest.raises(ConfigError) as e:
        check_options(SPEC, {"root": "/x", "token": 1234567})
    assert e.value.value == HIDDEN


def test_the_config_parser_checks_what_the_tier_declares() -> None:
    assert declared_options(FsTier) is FsTier.OPTIONS
    with pytest.raises(ConfigError) as e:
        check_tier_options("secondary_tiers[0]", FsTier, {"root_dir": "/x", "n_read_threads": 0})
    assert e.value.key == "secondary_tiers[0].n_read_threads"


def test_a_plugin_without_a_spec_is_checked_against_its_signature() -> None:
    assert declared_options(DelayedMemoryTier) is None and declared_options(RetryOnceTier) is None
    check_tier_options("t", DelayedMemoryTier, {"delay_s": "not checked by kvtier"})
    with pytest.raises(ConfigError, match="did you mean 'delay_s'"):
        check_tier_options("t", DelayedMemoryTier, {"delay": 1})
    with pytest.raises(ConfigError) as e:
        check_tier_options("t", RetryOnceTier, {"max_bytes": 1})
    assert e.value.key == "t.max_bytes"
