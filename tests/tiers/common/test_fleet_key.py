"""The fleet key file and the MACed chunk format: what is refused, and why each forgery fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.fleetkey import FleetKey

KEY = bytes(range(32))
FP = bytes.fromhex("00112233445566778899aabbccddeeff")


def key_file(tmp_path: Path, content: bytes = KEY, mode: int = 0o600, name: str = "fleet.key") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_a_key_file_readable_by_group_is_refused_naming_the_option_and_path(tmp_path: Path) -> None:
    path = key_file(tmp_path, mode=0o640)
    with pytest.raises(ConfigError) as e:
        KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20, "fleet_key_file": str(path)})
    assert e.value.key == "fleet_key_file"
    assert str(path) in str(e.value) and "0640" in str(e.value)
    assert KEY.hex() not in str(e.value)


@pytest.mark.parametrize("mode", [0o604, 0o644, 0o660])
def test_a_key_file_other_than_private_is_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ConfigError, match="group or others"):
        FleetKey.from_file(str(key_file(tmp_path, mode=mode)))


def test_a_short_key_is_refused_and_a_missing_file_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds 31 bytes"):
        FleetKey.from_file(str(key_file(tmp_path, KEY[:31])))
    with pytest.raises(ConfigError, match="cannot open") as e:
        FleetKey.from_file(str(tmp_path / "absent"))
    assert e.value.value == str(tmp_path / "absent")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "fifo"
    os.mkfifo(path, 0o600)
    with pytest.raises(ConfigError, match="regular file"):
        FleetKey.from_file(str(path))


def test_the_config_keeps_the_path_never_the_key(tmp_path: Path) -> None:
    path = key_file(tmp_path)
    config = KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20, "fleet_key_file": str(path)})
    assert config.fleet_key_file == str(path)
    assert KEY.hex() not in repr(config) and repr(KEY) not in repr(config)
    assert KEY.hex() not in repr(FleetKey.from_file(str(path)))


def test_without_a_key_the_header_is_todays() -> None:
    payload = os.urandom(8192)
    header = chunkfmt.header_bytes(KEY, FP, payload)
    assert header[10:12] == b"\0\0" and header[72:88] == chunkfmt.checksum(payload)
    assert chunkfmt.verify(header, payload, KEY, FP) is None


def test_each_forgery_fails_under_the_key() -> None:
    fleet, other = FleetKey.from_bytes(KEY), FleetKey.from_bytes(bytes(32))
    payload = os.urandom(8192)
    sealed = chunkfmt.header_bytes(KEY, FP, payload, fleet)
    assert chunkfmt.verify(sealed, payload, KEY, FP, fleet) is None
    assert chunkfmt.verify(sealed, payload, KEY, FP) is ChunkError.MAC  # an unkeyed reader refuses
    unkeyed = chunkfmt.header_bytes(KEY, FP, payload)
    assert chunkfmt.verify(unkeyed, payload, KEY, FP, fleet) is ChunkError.MAC
    assert chunkfmt.verify(chunkfmt.header_bytes(KEY, FP, payload, other), payload, KEY, FP,
                           fleet) is ChunkError.MAC
    swapped = bytearray(payload)
    swapped[100] ^= 1
    assert chunkfmt.verify(sealed, bytes(swapped), KEY, FP, fleet) is ChunkError.MAC
    # the header's fields are covered too: a MAC copied onto another key's header fails
    moved = bytearray(chunkfmt.header_bytes(bytes(32), FP, payload, fleet))
    moved[16:48] = KEY
    assert chunkfmt.verify(bytes(moved), payload, KEY, FP, fleet) is ChunkError.MAC


def test_a_streamed_digest_is_the_whole_payloads() -> None:
    fleet = FleetKey.from_bytes(KEY)
    payload = os.urandom(3 * 4096 + 7)
    header = chunkfmt.header_bytes(KEY, FP, payload, fleet)
    err, expected = chunkfmt.check_header(header, KEY, FP, len(payload), fleet)
    assert err is None
    digest = chunkfmt.payload_digest(header, fleet)
    for start in range(0, len(payload), 1000):
        digest.update(payload[start : start + 1000])
    assert chunkfmt.check_digest(digest.digest(), expected, fleet) is None
    assert expected == chunkfmt.digest_of(KEY, FP, payload, fleet)
