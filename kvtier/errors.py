"""Typed exceptions raised to users of kvtier.

Failures inside the data path (a tier that cannot store or load a chunk) never raise: they travel
as values (`JobResult(success=False)`). These exceptions are for setup and user input only.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class KVTierError(Exception):
    """Base class of every exception kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing, malformed or out of range.

    The message always names the key (as a dotted path), the offending value and what is allowed.
    """

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"kvtier config: {key} = {value!r} is invalid: {allowed}")


def unknown_name_message(name: str, known: Iterable[str]) -> str:
    """Describe what is allowed instead of `name`, with the closest known name first."""
    known_sorted = sorted(known)
    close = difflib.get_close_matches(name, known_sorted, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}known: {', '.join(known_sorted) or '(none)'}"
