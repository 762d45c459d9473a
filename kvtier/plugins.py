"""Name → class resolution for pluggable parts (tiers, eviction policies, admission policies).

A built-in is named by a short type name. An external plugin is named by its class name plus a
`module_path` to import it from; it must subclass the contract of its kind. Unknown names raise a
ConfigError that lists the known names, closest first.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TypeVar

from kvtier.errors import ConfigError, unknown_name_message

T = TypeVar("T")


def resolve_plugin(
    key: str,
    name: object,
    module_path: object,
    builtins: Mapping[str, str],
    base: type[T],
) -> type[T]:
    """The class for `name`: a built-in ("module:Class" in `builtins`) or `module_path`.`name`.

    `key` is the config path used in error messages (e.g. "secondary_tiers[0].type").
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(key, name, "must be a non-empty string")
    if module_path is None:
        target = builtins.get(name)
        if target is None:
            raise ConfigError(key, name, unknown_name_message(name, builtins))
        module_name, _, attr = target.partition(":")
    else:
        if not isinstance(module_path, str) or not module_path:
            raise ConfigError(key.rsplit(".", 1)[0] + ".module_path", module_path,
                              "must be an importable module name")
        module_name, attr = module_path, name
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(key, name, f"cannot import module {module_name!r}: {e}") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not issubclass(cls, base):
        raise ConfigError(
            key, name, f"{module_name}.{attr} must be a class deriving from {base.__qualname__}"
        )
    return cls
