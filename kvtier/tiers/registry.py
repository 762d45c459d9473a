"""Secondary-tier types: built-in names, `module_path` plugins, and option checking.

Options are checked in the configuring process, so a misspelt option or a bad value fails at startup
with the dotted key named (and the closest known option suggested), before any process starts: a
tier that declares `OPTIONS` is checked against them (`common.options`), exactly as its constructor
checks them; a plugin that declares none is checked against its constructor's signature (names
only: its constructor checks the values).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError, unknown_name_message
from kvtier.plugins import resolve_plugin
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.common.options import Option, check_options

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


def declared_options(cls: type[SecondaryTier]) -> tuple[Option, ...] | None:
    """The options `cls`'s constructor checks: the `OPTIONS` of the nearest class (in method
    resolution order) that defines `OPTIONS` or `__init__`; None when that class defines only
    `__init__` (a plugin without a declaration)."""
    for klass in cls.__mro__:
        if "OPTIONS" in vars(klass):
            options: tuple[Option, ...] = vars(klass)["OPTIONS"]
            return options
        if "__init__" in vars(klass):
            return None
    return None


def check_tier_options(key: str, cls: type[SecondaryTier], options: Mapping[str, Any]) -> None:
    """Raise ConfigError naming `key.<option>` when `options` has an unknown option, lacks a
    required one, or (for a tier that declares its options) has a value out of kind or bounds."""
    declared = declared_options(cls)
    if declared is not None:
        check_options(declared, options, prefix=f"{key}.")
        return
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    known = [p.name for p in params if p.name != "ctx" and p.kind is not p.VAR_POSITIONAL]
    for name in options:
        if name not in known:
            raise ConfigError(f"{key}.{name}", options[name], unknown_name_message(name, known))
    for p in params:
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in options:
            raise ConfigError(f"{key}.{p.name}", None, f"required by tier {cls.__name__}")
