"""A chunk in the engine's hash space: the engine blocks it covers, as the engine's own KV events
name them (vLLM's, today).

vLLM names each full engine block by its prefix-cache block hash (chained over the tokens of every
block before it, with its extras: cache salt, LoRA, multimodal hashes); a KV-aware router indexes
those hashes, and parents link them into prefixes. A kvtier chunk is `blocks_per_chunk` engine
blocks: `ChunkBlocks` keeps their raw vLLM hashes, the hash of the block before the chunk, and the
chunk's token ids, which is everything a `BlockStored` or `BlockRemoved` event for the chunk needs.
Raw hashes are kept (not the 64-bit ints routers read) so the conversion stays vLLM's own
(`maybe_convert_block_hash`, which follows `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), applied when an
event is built.

An integration reads them from its live requests (vLLM's: `kv_events.request_chunks`);
`pack`/`unpack` are the fixed binary form the fs tier's sidecar files hold (`block_sidecar.py`).
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass

from kvtier.format.chunks import ChunkKey

_HEAD = struct.Struct("<32sIHHBqH")
"""chunk key, block size, hash length, blocks in the chunk, has a parent (0/1), LoRA adapter id
(-1: none), length of the LoRA name (UTF-8, after the token ids)."""


@dataclass(frozen=True)
class ChunkBlocks:
    """One chunk as vLLM's engine blocks: `hashes[i]` is vLLM's raw block hash of the chunk's block
    i, `parent` the hash of the block just before the chunk (None: the chunk starts the prompt),
    `tokens` the chunk's token ids (`len(hashes)` blocks of equal size), and `lora` the LoRA adapter
    (name, id) the request ran with, which vLLM's events carry and routers hash with the tokens."""

    hashes: tuple[bytes, ...]
    parent: bytes | None
    tokens: array[int]
    lora: tuple[str, int] | None = None

    def pack(self, key: ChunkKey, block_size: int) -> bytes:
        """The binary form: a header naming `key` and `block_size`, the hashes, the parent, the
        token ids (uint32), the LoRA name."""
        width = len(self.hashes[0])
        parent = self.parent if self.parent is not None else b""
        name, lora_id = (self.lora[0].encode(), self.lora[1]) if self.lora else (b"", -1)
        head = _HEAD.pack(key, block_size, width, len(self.hashes), int(self.parent is not None),
                          lora_id, len(name))
        return b"".join((head, *self.hashes, parent, array("I", self.tokens).tobytes(), name))

    @staticmethod
    def unpack(data: bytes, key: ChunkKey, block_size: int) -> ChunkBlocks | None:
        """The record `pack(key, block_size)` wrote; None when `data` is not one (another key,
        another block size, a short or foreign record)."""
        if len(data) < _HEAD.size:
            return None
        named, size, width, blocks, has_parent, lora_id, name_len = _HEAD.unpack_from(data)
        tokens_at = _HEAD.size + width * (blocks + has_parent)
        name_at = tokens_at + 4 * blocks * block_size
        if (named, size) != (key, block_size) or not width or not blocks or has_parent > 1 \
                or len(data) != name_at + name_len:
            return None
        hashes = tuple(data[_HEAD.size + i * width : _HEAD.size + (i + 1) * width]
                       for i in range(blocks))
        parent = data[tokens_at - width : tokens_at] if has_parent else None
        try:
            lora = (data[name_at:].decode(), lora_id) if lora_id >= 0 else None
        except UnicodeDecodeError:
            return None
        return ChunkBlocks(hashes, parent, array("I", data[tokens_at:name_at]), lora)
