"""Secondary-tier types: built-in names, `module_path` plugins, and option checking.

Options are checked against the tier class's constructor signature in the configuring process, so
a misspelt option fails at startup with the closest known option named, before any process starts.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError, unknown_name_message
from kvtier.plugins import resolve_plugin
from kvtier.tiers.base import SecondaryTier

BUILTIN_TIERS: dict[str, str] = {
    "memory": "kvtier.tiers.memory:MemoryTier",
    "fs": "kvtier.tiers.fs.tier:FsTier",
    "obj": "kvtier.tiers.obj.tier:ObjTier",
    "redis": "kvtier.tiers.redis.tier:RedisTier",
    "p2p": "kvtier.tiers.p2p:P2PTier",
}


def resolve_tier(key: str, type_name: object, module_path: object) -> type[SecondaryTier]:
    """The tier class for a config entry; `key` is the entry's config path."""
    return resolve_plugin(f"{key}.type", type_name, module_path, BUILTIN_TIERS, SecondaryTier)


def tier_option_names(cls: type[SecondaryTier]) -> list[str]:
    """The keyword options a tier class accepts (every constructor parameter but `ctx`)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [p.name for p in params if p.name != "ctx" and p.kind is not p.VAR_POSITIONAL]


def check_tier_options(key: str, cls: type[SecondaryTier], options: Mapping[str, Any]) -> None:
    """Raise ConfigError when `options` has an unknown option or lacks a required one."""
    sig = inspect.signature(cls.__init__)
    params = list(sig.parameters.values())[1:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    known = tier_option_names(cls)
    for name in options:
        if name not in known:
            raise ConfigError(f"{key}.{name}", options[name], unknown_name_message(name, known))
    for p in params:
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in options:
            raise ConfigError(f"{key}.{p.name}", None, f"required by tier {cls.__name__}")


def number_option(key: str, value: object, allowed: str, *, low: float, integer: bool = False) -> float:
    """`value` as a float when it is a finite number >= `low` (an int when `integer`), else a
    ConfigError naming `key` and saying what is `allowed`. Booleans are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        raise ConfigError(key, value, allowed)
    if not math.isfinite(value) or value < low:
        raise ConfigError(key, value, allowed)
    return float(value)
