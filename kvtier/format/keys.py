"""Chunk keys: a chained cryptographic hash of a request's token ids and what else shapes its KV.

Key `i` of a request names the KV of its first `(i + 1) * chunk_tokens` tokens:

    root  = H("kvtier.root.v1" | algorithm | model fingerprint | chunk_tokens | cache_salt | lora)
    key_i = H("kvtier.chunk.v1" | key_{i-1} (root for i = 0) | token ids of chunk i | mm spans of i)

Every variable-length field is length-prefixed (and optional ones carry a presence byte), so two
different inputs never encode to the same bytes. Token ids are little-endian uint32. The digests
depend only on these bytes: keys are the same in every process and on every machine (no
PYTHONHASHSEED, no pickle). Tensor-parallel degree and attention backend are deliberately not
hashed: the stored bytes are in the canonical layout (`kvtier.format.layout`), identical for all of them.

Consequences the rest of kvtier relies on:

- Prefix property: the keys of a prefix of a token sequence are a prefix of its keys.
- A full chunk's key is in the chain; an unfull chunk (the whole engine blocks that follow a
  request's last full chunk, fewer than a chunk) gets a key of its own beside it:

      unfull = H("kvtier.unfull.v1" | key of the chunk before (root for none) | its token ids)

  An unfull key is never a parent: the chain goes on from full chunks only. Its token count is
  in its input (token ids are length-prefixed), so an unfull chunk of b blocks is found only by a
  request whose tokens there are the same b blocks' tokens.
- A key is 32 bytes, for both sha256 and blake3.

`ChunkHasher` is immutable and may be shared between threads.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

import numpy as np

from kvtier.errors import ConfigError

KEY_BYTES = 32
Algorithm = Literal["sha256", "blake3"]
ALGORITHMS: tuple[Algorithm, ...] = ("sha256", "blake3")

_ROOT_TAG = b"kvtier.root.v1"
_CHUNK_TAG = b"kvtier.chunk.v1"
_UNFULL_TAG = b"kvtier.unfull.v1"
_FINGERPRINT_TAG = b"kvtier.model.v1"
_U32 = struct.Struct("<I")
_SPAN = struct.Struct("<qI")
_NATIVE_LITTLE = sys.byteorder == "little" and array.array("I").itemsize == 4


class _Hash(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...


def _blob(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _text(value: str) -> bytes:
    return _blob(value.encode("utf-8"))


def _optional(value: str | bytes | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return b"\x01" + _blob(raw)


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything about the model that changes the bytes of its KV cache.

    Two engines may share chunks only when their fingerprints are equal. `extra` holds anything
    else that changes the KV (rope scaling, a sliding window, a KV quantization scale scheme...)
    as sorted (name, value) pairs; `quantization` names the weight quantization, if any.
    """

    model: str
    revision: str
    dtype: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quantization: str = ""
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name}", value, "a positive integer")
        if list(self.extra) != sorted(set(self.extra)):
            raise ConfigError("model.extra", self.extra, "sorted, distinct (name, value) pairs")

    def digest(self) -> bytes:
        """A stable 32-byte sha256 digest of every field, independent of the key algorithm."""
        parts = [_FINGERPRINT_TAG]
        for f in fields(self):
            value: Any = getattr(self, f.name)
            parts.append(_text(f.name))
            if isinstance(value, int):
                parts.append(struct.pack("<q", value))
            elif isinstance(value, str):
                parts.append(_text(value))
            else:
                parts.append(_U32.pack(len(value)))
                parts.extend(_text(k) + _text(v) for k, v in value)
        return hashlib.sha256(b"".join(parts)).digest()


@dataclass(frozen=True)
class MultiModalSpan:
    """A multimodal item (image, audio...) whose placeholder tokens are
    `[offset, offset + length)` of the token sequence, identified by the hash of its content."""

    offset: int
    length: int
    hash: bytes | str

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                "multimodal span needs offset >= 0 and length > 0, "
                f"got offset {self.offset}, length {self.length}"
            )

    def encode(self, chunk_start: int) -> bytes:
        raw = self.hash.encode("utf-8") if isinstance(self.hash, str) else bytes(self.hash)
        return _SPAN.pack(self.offset - chunk_start, self.length) + _blob(raw)


def _hash_factory(algorithm: str) -> Callable[[bytes], _Hash]:
    if algorithm == "sha256":
        return hashlib.sha256
    if algorithm == "blake3":
        try:
            from blake3 import blake3
        except ImportError as exc:
            raise ConfigError(
                "hash_algorithm", algorithm, "blake3 needs the `blake3` package (pip install blake3)"
            ) from exc
        factory: Callable[[bytes], _Hash] = blake3
        return factory
    raise ConfigError("hash_algorithm", algorithm, f"one of {', '.join(ALGORITHMS)}")


def _token_bytes(token_ids: Sequence[int] | np.ndarray[Any, Any]) -> memoryview:
    """Little-endian uint32 bytes of the token ids; out-of-range ids raise ValueError."""
    if isinstance(token_ids, np.ndarray) or not _NATIVE_LITTLE:
        arr = np.asarray(token_ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"token ids must be a 1-D sequence of integers, got {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise ValueError("token ids must lie in [0, 2**32)")
        return memoryview(arr.astype("<u4", copy=False).tobytes())
    try:
        return memoryview(array.array("I", token_ids)).cast("B")
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc


class ChunkHasher:
    """Computes the chained keys of full `chunk_tokens`-token chunks (see the module docstring)."""

    def __init__(self, algorithm: str, fingerprint: ModelFingerprint, chunk_tokens: int) -> None:
        if not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
            raise ConfigError("chunk_tokens", chunk_tokens, "a positive integer")
        self.algorithm = algorithm
        self.fingerprint = fingerprint
        self.chunk_tokens = chunk_tokens
        self._new = _hash_factory(algorithm)
        self._base = _text(algorithm) + fingerprint.digest() + struct.pack("<q", chunk_tokens)
        self._chunk_prefix = _blob(_CHUNK_TAG) + _U32.pack(4 * chunk_tokens)

    def root(self, *, cache_salt: str | bytes | None = None, lora: str | None = None) -> bytes:
        """The parent of a request's first chunk."""
        h = self._new(_blob(_ROOT_TAG) + self._base + _optional(cache_salt) + _optional(lora))
        return h.digest()

    def keys(
        self,
        token_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        cache_salt: str | bytes | None = None,
        lora: str | None = None,
        mm_hashes: Sequence[MultiModalSpan] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """One key per full chunk of `token_ids`.

        With `parent`, `token_ids` continue the sequence whose last full chunk has key `parent`
        (cache_salt and lora are then already in `parent` and ignored), and multimodal offsets
        count from `token_ids[0]`.
        """
        if parent is not None and len(parent) != KEY_BYTES:
            raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
        first = parent if parent is not None else self.root(cache_salt=cache_salt, lora=lora)
        return self._chain(first, token_ids, 0, mm_hashes or ())

    def extend(
        self,
        prev_keys: Sequence[bytes],
        token_ids: Sequence[int] | np.ndarray[Any, Any],
        *,
        cache_salt: str | bytes | None = None,
        lora: str | None = None,
        mm_hashes: Sequence[MultiModalSpan] | None = None,
    ) -> list[bytes]:
        """The keys of the full chunks of `token_ids` (the whole sequence so far) that come after
        the `len(prev_keys)` chunks already keyed; `prev_keys + result == keys(token_ids, ...)`.

        Only the new tokens are hashed. Multimodal offsets are positions in the whole sequence.
        """
        done = len(prev_keys)
        start = done * self.chunk_tokens
        if len(token_ids) < start:
            raise ValueError(
                f"{len(prev_keys)} previous keys cover {start} tokens, "
                f"but only {len(token_ids)} token ids were given"
            )
        parent = prev_keys[-1] if done else self.root(cache_salt=cache_salt, lora=lora)
        return self._chain(parent, token_ids[start:], start, mm_hashes or ())

    def unfull_key(self, parent: bytes, token_ids: Sequence[int] | np.ndarray[Any, Any]) -> bytes:
        """The key of the unfull chunk `token_ids` (fewer than `chunk_tokens`, at least one) that
        follows the full chunk whose key is `parent` (the request's `root` for none)."""
        if not 0 < len(token_ids) < self.chunk_tokens:
            raise ValueError(f"an unfull chunk holds 1 to {self.chunk_tokens - 1} tokens, "
                             f"got {len(token_ids)}")
        if len(parent) != KEY_BYTES:
            raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
        data = _token_bytes(token_ids)
        h = self._new(_blob(_UNFULL_TAG) + _U32.pack(len(data)))
        h.update(parent)
        h.update(data)
        return h.digest()

    def _chain(
        self,
        parent: bytes,
        token_ids: Sequence[int] | np.ndarray[Any, Any],
        start: int,
        spans: Sequence[MultiModalSpan],
    ) -> list[bytes]:
        n_chunks = len(token_ids) // self.chunk_tokens
        if n_chunks == 0:
            return []
        step = 4 * self.chunk_tokens
        data = _token_bytes(token_ids[: n_chunks * self.chunk_tokens])
        new, prefix, out = self._new, self._chunk_prefix, []
        no_span = _U32.pack(0)
        for i in range(n_chunks):
            h = new(prefix)
            h.update(parent)
            h.update(data[i * step : (i + 1) * step])
            h.update(self._span_bytes(spans, start + i * self.chunk_tokens) if spans else no_span)
            parent = h.digest()
            out.append(parent)
        return out

    def _span_bytes(self, spans: Sequence[MultiModalSpan], chunk_start: int) -> bytes:
        chunk_end = chunk_start + self.chunk_tokens
        hit = [s for s in spans if s.offset < chunk_end and s.offset + s.length > chunk_start]
        return _U32.pack(len(hit)) + b"".join(s.encode(chunk_start) for s in hit)
