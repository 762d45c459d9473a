"""Chunk keys: determinism, sensitivity to every input, prefix property, incremental extension."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.format.keys import ALGORITHMS, KEY_BYTES, ChunkHasher, ModelFingerprint, MultiModalSpan

FP = ModelFingerprint(
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    revision="main",
    dtype="bfloat16",
    kv_dtype="bfloat16",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)
C = 16
TOKENS = [(i * 7919 + 13) % 49152 for i in range(5 * C + 3)]

_CHILD = """
import json, sys
from kvtier.format.keys import ChunkHasher, ModelFingerprint, MultiModalSpan
fp = ModelFingerprint(**json.loads(sys.argv[1]))
h = ChunkHasher(sys.argv[2], fp, int(sys.argv[3]))
toks = json.loads(sys.argv[4])
keys = h.keys(toks, cache_salt="s", lora="l", mm_hashes=[MultiModalSpan(3, 20, "img")])
print(json.dumps([k.hex() for k in keys]))
"""


@pytest.fixture(params=ALGORITHMS)
def hasher(request: pytest.FixtureRequest) -> ChunkHasher:
    return ChunkHasher(request.param, FP, C)


def test_one_32_byte_key_per_full_chunk(hasher: ChunkHasher) -> None:
    keys = hasher.keys(TOKENS)
    assert len(keys) == 5
    assert all(len(k) == 32 for k in keys)
    assert len(set(keys)) == 5
    assert hasher.keys(TOKENS[: C - 1]) == []
    assert hasher.keys(TOKENS[: 2 * C + C - 1]) == keys[:2]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deterministic_across_processes(algorithm: str) -> None:
    here = ChunkHasher(algorithm, FP, C).keys(
        TOKENS, cache_salt="s", lora="l", mm_hashes=[MultiModalSpan(3, 20, "img")]
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    args = [json.dumps(dataclasses.asdict(FP)), algorithm, str(C), json.dumps(TOKENS)]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [k.hex() for k in here]


def test_prefix_property(hasher: ChunkHasher) -> None:
    full = hasher.keys(TOKENS, cache_salt="x")
    for n in range(len(TOKENS) + 1):
        assert hasher.keys(TOKENS[:n], cache_salt="x") == full[: n // C]


def test_extend_equals_full(hasher: ChunkHasher) -> None:
    spans = [MultiModalSpan(C + 2, C, b"\x01" * 32)]
    extras = {"cache_salt": b"salt", "lora": "adapter", "mm_hashes": spans}
    full = hasher.keys(TOKENS, **extras)  # type: ignore[arg-type]
    keys: list[bytes] = []
    for n in (0, 5, C, C + 1, 3 * C + 2, len(TOKENS)):
        keys += hasher.extend(keys, TOKENS[:n], **extras)  # type: ignore[arg-type]
        assert keys == full[: n // C]
    assert keys == full


def test_parent_continues_the_chain(hasher: ChunkHasher) -> None:
    full = hasher.keys(TOKENS, lora="a")
    rest = hasher.keys(TOKENS[2 * C :], parent=full[1])
    assert full[:2] + rest == full


def test_numpy_and_list_inputs_agree(hasher: ChunkHasher) -> None:
    expected = hasher.keys(TOKENS)
    assert hasher.keys(np.array(TOKENS, dtype=np.int64)) == expected
    assert hasher.keys(np.array(TOKENS, dtype=">u4")) == expected


@pytest.mark.parametrize(
    "extras",
    [
        {"cache_salt": "a"},
        {"cache_salt": ""},
        {"cache_salt": b"a"},
        {"lora": "adapter"},
        {"lora": ""},
        {"mm_hashes": [MultiModalSpan(0, 4, "img")]},
    ],
)
def test_each_extra_changes_every_key(hasher: ChunkHasher, extras: dict[str, object]) -> None:
    base = hasher.keys(TOKENS)
    changed = hasher.keys(TOKENS, **extras)  # type: ignore[arg-type]
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_none_and_empty_extras_differ(hasher: ChunkHasher) -> None:
    assert hasher.keys(TOKENS, cache_salt="") != hasher.keys(TOKENS, lora="")
    assert hasher.keys(TOKENS, cache_salt="ab") != hasher.keys(TOKENS, cache_salt="a", lora="b")


def test_multimodal_span_affects_its_chunk_onwards(hasher: ChunkHasher) -> None:
    base = hasher.keys(TOKENS)
    a = hasher.keys(TOKENS, mm_hashes=[MultiModalSpan(2 * C + 1, 3, "img-a")])
    b = hasher.keys(TOKENS, mm_hashes=[MultiModalSpan(2 * C + 1, 3, "img-b")])
    moved = hasher.keys(TOKENS, mm_hashes=[MultiModalSpan(2 * C + 2, 3, "img-a")])
    assert a[:2] == base[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    assert a[2] != moved[2] and a[2] != base[2]


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "other"),
        ("revision", "v2"),
        ("dtype", "float16"),
        ("kv_dtype", "fp8_e4m3"),
        ("num_layers", 31),
        ("num_kv_heads", 4),
        ("head_dim", 128),
        ("quantization", "awq"),
        ("extra", (("rope_scaling", "yarn"),)),
    ],
)
def test_fingerprint_fields_change_keys(field: str, value: object) -> None:
    other = dataclasses.replace(FP, **{field: value})  # type: ignore[arg-type]
    assert other.digest() != FP.digest()
    for algorithm in ALGORITHMS:
        assert (
            ChunkHasher(algorithm, other, C).keys(TOKENS)[0] != ChunkHasher(algorithm, FP, C).keys(TOKENS)[0]
        )


def test_token_ids_and_algorithms_and_chunk_size_matter() -> None:
    sha, b3 = ChunkHasher("sha256", FP, C), ChunkHasher("blake3", FP, C)
    assert sha.keys(TOKENS) != b3.keys(TOKENS)
    changed = list(TOKENS)
    changed[C + 3] += 1
    k0, k1 = sha.keys(TOKENS), sha.keys(changed)
    assert k0[0] == k1[0] and all(a != b for a, b in zip(k0[1:], k1[1:], strict=True))
    assert (
        ChunkHasher("sha256", FP, C).keys(TOKENS[: 2 * C])[1]
        != ChunkHasher("sha256", FP, 2 * C).keys(TOKENS[: 2 * C])[0]
    )


def test_invalid_inputs_raise_clear_errors() -> None:
    with pytest.raises(ConfigError, match="hash_algorithm"):
        ChunkHasher("md5", FP, C)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        ChunkHasher("sha256", FP, 0)
    with pytest.raises(ConfigError, match="num_layers"):
        dataclasses.replace(FP, num_layers=0)
    hasher = ChunkHasher("sha256", FP, C)
    for bad in ([-1] * C, [2**32] * C, np.full(C, -1)):
        with pytest.raises(ValueError, match="token ids"):
            hasher.keys(bad)
    with pytest.raises(ValueError, match="parent"):
        hasher.keys(TOKENS, parent=b"short")
    with pytest.raises(ValueError, match="previous keys"):
        hasher.extend(hasher.keys(TOKENS), TOKENS[:C])
    with pytest.raises(ValueError, match="multimodal"):
        MultiModalSpan(0, 0, "x")


def test_an_unfull_key_names_its_parent_and_each_token_of_it() -> None:
    hasher = ChunkHasher("sha256", FP, 8)
    tokens = list(range(20))
    keys = hasher.keys(tokens)
    four = hasher.unfull_key(keys[1], tokens[16:20])
    assert four not in keys and len(four) == KEY_BYTES
    assert hasher.unfull_key(keys[1], tokens[16:20]) == four  # deterministic
    assert hasher.unfull_key(keys[1], tokens[16:19]) != four  # one token fewer
    assert hasher.unfull_key(keys[0], tokens[16:20]) != four  # another parent
    assert hasher.unfull_key(keys[1], [*tokens[16:19], 99]) != four
    # Never a chain key: the full chunk of the same tokens has another key.
    assert hasher.unfull_key(keys[0], tokens[8:15]) != keys[1]
    with pytest.raises(ValueError, match="1 to 7 tokens"):
        hasher.unfull_key(keys[1], tokens[:8])
    with pytest.raises(ValueError, match="1 to 7 tokens"):
        hasher.unfull_key(keys[1], [])
