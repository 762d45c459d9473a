"""The fleet key: an optional secret shared by the instances of a fleet, with which every stored
chunk's header fields and payload are MACed (`chunkfmt`), so that whoever can write a shared tier
but lacks the key cannot make kvtier load bytes it did not store.

The key is the bytes of a file (`head -c 32 /dev/urandom > key; chmod 600 key`), never a value on
a command line or in a config: the config names the file (`fleet_key_file`) and each tier process
reads it. The file must be a regular file that neither group nor others may read, of
MIN_KEY_BYTES to MAX_KEY_BYTES; any other is refused with a `ConfigError` naming the option and
the path, never a byte of the key. Symbolic links are followed (secret volumes are mounted as
links); the file they reach is what is checked.

The MAC is keyed BLAKE3 truncated to DIGEST_BYTES. Its 32-byte key is derived from the file's
bytes in BLAKE3's key-derivation mode under a fixed context, so the same file gives the same MAC on
every machine. `FleetKey` never shows the key (its repr names the file only).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from blake3 import blake3

from kvtier.errors import ConfigError

OPTION = "fleet_key_file"
"""The config key that names the fleet key file."""
MIN_KEY_BYTES = 32
MAX_KEY_BYTES = 4096
DIGEST_BYTES = 16
"""A MAC is as wide as the chunk header's checksum field."""
_CONTEXT = "kvtier 2026-12 fleet key: stored chunk MAC v1"


class ChunkMac:
    """A streaming MAC: `update` with the bytes in order, then `digest` (DIGEST_BYTES)."""

    def __init__(self, key: bytes) -> None:
        self._hasher = blake3(key=key)

    def update(self, data: memoryview | bytes | bytearray) -> None:
        self._hasher.update(data)

    def digest(self) -> bytes:
        return self._hasher.digest(length=DIGEST_BYTES)


@dataclass(frozen=True)
class FleetKey:
    """A loaded fleet key. `path` is where it was read from (for messages); the key is not shown."""

    path: str
    _mac_key: bytes = field(repr=False, compare=False)

    @classmethod
    def from_bytes(cls, material: bytes, path: str = "<bytes>") -> FleetKey:
        """The fleet key whose file holds `material` (at least MIN_KEY_BYTES bytes)."""
        if len(material) < MIN_KEY_BYTES:
            raise ValueError(f"a fleet key needs at least {MIN_KEY_BYTES} bytes")
        return cls(path, blake3(material, derive_key_context=_CONTEXT).digest(length=32))

    @classmethod
    def from_file(cls, path: str, option: str = OPTION) -> FleetKey:
        """Read and check the key file `path`; raises ConfigError (naming `option` and `path`)
        when it cannot be read, is not a regular file, is readable by group or others, or has
        fewer than MIN_KEY_BYTES or more than MAX_KEY_BYTES bytes."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(option, path, f"cannot open the fleet key file: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(option, path, "the fleet key file must be a regular file")
            if st.st_mode & 0o077:
                raise ConfigError(option, path, f"the fleet key file has mode "
                                  f"{stat.S_IMODE(st.st_mode):04o}, readable by group or others: "
                                  f"it must be private to its owner (chmod 600 {path})")
            material = os.read(fd, MAX_KEY_BYTES + 1)
        finally:
            os.close(fd)
        if not MIN_KEY_BYTES <= len(material) <= MAX_KEY_BYTES:
            raise ConfigError(option, path, f"the fleet key file holds {len(material)} bytes: it "
                              f"needs {MIN_KEY_BYTES} to {MAX_KEY_BYTES} (head -c 32 /dev/urandom)")
        return cls.from_bytes(material, path)

    def mac(self) -> ChunkMac:
        """A fresh streaming MAC under this key."""
        return ChunkMac(self._mac_key)
