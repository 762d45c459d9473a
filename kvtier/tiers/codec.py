"""The field encodings of the tier messages (`kvtier.tiers.messages`): how a payload's fields are
written and read back, with every read checked.

Integers are u8, u32 or u64, floats IEEE f64, all in network order; a flag is one byte 0 or 1; text
is a u32 length then UTF-8; a list of chunk keys is a u32 count, one u16 length per key, then the
keys' bytes; an enum member is its index in its enum (one byte); a `Scalar` is a one-byte tag then
its value (an int as decimal text, so any size crosses).

A `FieldReader` raises `MessageError` for a field cut short or out of range; what building kvtier's
own types from the fields raises (`ValueError`, a `struct.error`) is wrapped by `messages.decode`
into `MessageError` too. Each writer or reader serves one message on one thread.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import Any, TypeVar

from kvtier.errors import KVTierError
from kvtier.format.chunks import ChunkKey

_E = TypeVar("_E", bound=enum.Enum)

Scalar = str | int | float | bool | None
"""A `ConfigError` value as it crosses: plain values as they are, anything else as its repr."""

U8, U32, U64, F64 = (struct.Struct(f"!{c}") for c in "BIQd")
_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR = range(6)


class MessageError(KVTierError):
    """A frame that is not a valid message of this format version, or a message that cannot be
    framed."""


class FieldWriter:
    """Collects a payload's fields, in order."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def pack(self, fmt: struct.Struct, *values: float) -> None:
        """`values` as the fields of `fmt`, one struct (several fields: one call, not several)."""
        try:
            self.parts.append(fmt.pack(*values))
        except struct.error as e:
            raise MessageError(f"{values!r} do not fit the fields {fmt.format}: {e}") from e

    def flag(self, value: bool) -> None:
        self.pack(U8, int(bool(value)))

    def text(self, value: str) -> None:
        if not isinstance(value, str):
            raise MessageError(f"expected text, got {type(value).__name__}")
        data = value.encode()
        self.pack(U32, len(data))
        self.parts.append(data)

    def keys(self, keys: Sequence[ChunkKey]) -> None:
        if not all(isinstance(k, bytes) for k in keys):
            raise MessageError("a chunk key must be bytes")
        self.pack(U32, len(keys))
        try:
            self.parts.append(struct.pack(f"!{len(keys)}H", *map(len, keys)))
        except struct.error as e:
            raise MessageError(f"a chunk key is over 65535 bytes: {e}") from e
        self.parts.append(b"".join(keys))

    def member(self, member: enum.Enum) -> None:
        self.pack(U8, list(type(member)).index(member))

    def scalar(self, value: Scalar) -> None:
        if value is None or isinstance(value, bool):
            self.pack(U8, _NONE if value is None else _TRUE if value else _FALSE)
        elif isinstance(value, int):
            self.pack(U8, _INT)
            self.text(str(value))  # any size, as Python's ints are
        elif isinstance(value, float):
            self.pack(U8, _FLOAT)
            self.pack(F64, value)
        else:
            self.pack(U8, _STR)
            self.text(value)


class FieldReader:
    """Reads a payload's fields, in order; any shortfall or bad value is a `MessageError`."""

    def __init__(self, payload: bytes | bytearray | memoryview) -> None:
        self._buf = memoryview(payload)
        self._at = 0

    def take(self, n: int) -> memoryview:
        at = self._at
        if n > len(self._buf) - at:
            raise MessageError(f"truncated payload: {n} bytes wanted at {at} of {len(self._buf)}")
        self._at = at + n
        return self._buf[at:at + n]

    def record(self, fmt: struct.Struct) -> tuple[Any, ...]:
        """The fields of `fmt`, read in one call."""
        at = self._at
        if fmt.size > len(self._buf) - at:
            raise MessageError(f"truncated payload: {fmt.size} bytes wanted at {at} of {len(self._buf)}")
        self._at = at + fmt.size
        return fmt.unpack_from(self._buf, at)

    def unpack(self, fmt: struct.Struct) -> int:
        value: int = self.record(fmt)[0]
        return value

    def real(self) -> float:
        value: float = self.record(F64)[0]
        return value

    def flag(self) -> bool:
        value = self.unpack(U8)
        if value > 1:
            raise MessageError(f"a flag is 0 or 1, not {value}")
        return value == 1

    def text(self) -> str:
        try:
            return str(self.take(self.unpack(U32)), "utf-8")
        except UnicodeDecodeError as e:
            raise MessageError(f"text is not UTF-8: {e}") from e

    def keys(self) -> tuple[ChunkKey, ...]:
        count = self.unpack(U32)
        sizes = struct.unpack(f"!{count}H", self.take(2 * count))
        data = self.take(sum(sizes)).tobytes()
        width = sizes[0] if count else 0
        if width and sizes.count(width) == count:  # one key size, the usual case
            return tuple(data[at:at + width] for at in range(0, count * width, width))
        out, at = [], 0
        for size in sizes:
            out.append(data[at:at + size])
            at += size
        return tuple(out)

    def member(self, cls: type[_E]) -> _E:
        index, members = self.unpack(U8), list(cls)
        if index >= len(members):
            raise MessageError(f"no {cls.__name__} has index {index}")
        return members[index]

    def scalar(self) -> Scalar:
        tag = self.unpack(U8)
        if tag in (_NONE, _FALSE, _TRUE):
            return None if tag == _NONE else tag == _TRUE
        if tag == _INT:
            try:
                return int(self.text())
            except ValueError as e:
                raise MessageError(f"not an integer: {e}") from e
        if tag == _FLOAT:
            return self.real()
        if tag == _STR:
            return self.text()
        raise MessageError(f"unknown value tag {tag}")

    def end(self) -> None:
        if self._at != len(self._buf):
            raise MessageError(f"{len(self._buf) - self._at} bytes left after the last field")
