"""Tier options, declared once per tier and checked by one helper.

A tier declares its keyword options as a class-level tuple of `Option`s (`SecondaryTier.OPTIONS`):
name, kind, default and bounds. `check_options` checks a mapping of given options against it and
returns every declared option's value. Two callers: the config parser
(`registry.check_tier_options`, at parse time, naming the dotted key such as
`secondary_tiers[1].max_bytes`) and the tier's constructor (naming the bare option; the tier
process adds the entry's key). So a bad value fails at parse time with the message the tier itself
would give. What needs the tier's context (a bound in host rows, a reachable server, a readable
file) is checked by the constructor after this.

Errors are `ConfigError`s naming the key, the value (or `HIDDEN` for a secret, or what `show` makes
of it) and what is allowed; an unknown option is reported with the closest known one and never
with its value (a misspelt secret option is still a secret). An option with a `show` is a secret
(`kvtier.config.redact` prints it through `show`, `split_secrets` keeps it off command lines).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError, unknown_name_message

HIDDEN = "<hidden>"
"""What an error shows instead of a secret."""


class Kind(enum.Enum):
    """What an option's value is (JSON's types; booleans are not numbers here)."""

    INT = "an integer"
    NUMBER = "a number"
    BOOL = "true or false"
    TEXT = "a string"
    TEXTS = "a list of strings"


def hidden(value: object) -> str:
    """`show` for a secret option: the value never appears."""
    return HIDDEN


def word(value: str) -> bool:
    """`test` for a name used in keys: non-empty, without whitespace."""
    return bool(value) and not any(c.isspace() for c in value)


@dataclass(frozen=True)
class Option:
    """One keyword option of a tier.

    Numbers are finite, at least `low` and at most `high` (when set), and above 0 when `positive`.
    A string (each string of a list) passes `test` when set. None is allowed when the option is not
    `required` and its default is None or it is `nullable`. `allowed` replaces the generated
    description of what is allowed; `unit` ends it ("a positive number of seconds").
    """

    name: str
    kind: Kind
    default: Any = None
    low: float | None = None
    high: float | None = None
    positive: bool = False
    required: bool = False
    nullable: bool = False
    unit: str = ""
    test: Callable[[str], bool] | None = None
    allowed: str = ""
    show: Callable[[Any], object] | None = None

    @property
    def allows_none(self) -> bool:
        return not self.required and (self.default is None or self.nullable)

    def describe(self) -> str:
        """What is allowed, as an error says it ("must be an integer from 1 to 256")."""
        if self.allowed:
            return self.allowed
        what = self.kind.value
        if self.kind in (Kind.INT, Kind.NUMBER):
            noun = what.split()[-1]
            if self.low is not None and self.high is not None:
                what = f"{what} from {self.low:g} to {self.high:g}"
            elif self.positive:
                what = f"a positive {noun}"
            elif self.low == 0:
                what = f"a non-negative {noun}"
            elif self.low is not None:
                what = f"{what} >= {self.low:g}"
            what += f" of {self.unit}" if self.unit else ""
        return f"must be {'null or ' if self.allows_none else ''}{what}"

    def check(self, key: str, value: object) -> Any:
        """`value` when it fits, else a ConfigError naming `key`."""
        if value is None and self.allows_none:
            return None
        if not self._fits(value):
            shown = value if self.show is None or value is None else self.show(value)
            raise ConfigError(key, shown, self.describe())
        return value

    def _fits(self, value: object) -> bool:
        if self.kind is Kind.BOOL:
            return isinstance(value, bool)
        if self.kind is Kind.TEXT:
            return isinstance(value, str) and (self.test is None or self.test(value))
        if self.kind is Kind.TEXTS:
            return isinstance(value, list | tuple) and all(
                isinstance(v, str) and (self.test is None or self.test(v)) for v in value)
        if isinstance(value, bool) or not isinstance(value, int if self.kind is Kind.INT else int | float):
            return False
        return math.isfinite(value) and not (
            (self.low is not None and value < self.low) or (self.high is not None and value > self.high)
            or (self.positive and value <= 0))


def count(name: str, default: int, high: int) -> Option:
    """An integer option from 1 to `high` (threads, connections, batch sizes)."""
    return Option(name, Kind.INT, default, low=1, high=high)


def seconds(name: str, default: float | None, *, low: float | None = None, nullable: bool = False) -> Option:
    """A duration in seconds: positive, or at least `low` when given."""
    return Option(name, Kind.NUMBER, default, low=low, positive=low is None, nullable=nullable,
                  unit="seconds")


def max_bytes_option() -> Option:
    """A tier's bound in bytes (null: unbounded); the constructor also checks `at_least`."""
    return Option("max_bytes", Kind.NUMBER, positive=True, unit="bytes")


def at_least(name: str, value: float | None, low: int, what: str) -> None:
    """Raise ConfigError naming `name` when a bound is set below `low` bytes (`what`: "one row")."""
    if value is not None and value < low:
        raise ConfigError(name, value, f"must be null or hold at least {what} ({low} bytes)")


def check_options(options: Sequence[Option], given: Mapping[str, object], prefix: str = "") -> dict[str, Any]:
    """Every declared option's value: the given one, checked, else its default.

    Raises ConfigError naming `prefix + name` for an option not declared (suggesting the closest
    declared one), a required one missing, or a value of the wrong kind or out of bounds.
    """
    declared = {o.name: o for o in options}
    for name in given:
        if name not in declared:
            raise ConfigError(f"{prefix}{name}", HIDDEN, unknown_name_message(name, declared))
    out: dict[str, Any] = {}
    for o in options:
        if o.name in given:
            out[o.name] = o.check(f"{prefix}{o.name}", given[o.name])
        elif o.required:
            raise ConfigError(f"{prefix}{o.name}", None, f"required ({o.describe()})")
        else:
            out[o.name] = o.default
    return out
