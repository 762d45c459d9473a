"""The kvtier trace format: JSON lines, a header then one record per line; and its reader.

A trace file starts with a header line
`{"kvtier_trace": 1, "source": "connector"|"kv_events", "block_size": B, "blocks_per_chunk": K,
"chunk_bytes": N|null, "key_bytes": 8}`: `block_size` engine tokens per block, `K` blocks per
recorded chunk, `chunk_bytes` the KV bytes of one recorded chunk (null when the recorder did not
know them: `kvtier plan --bytes-per-token` supplies them).

Each following line is one record:

- a request (the connector's trace, one per finished request): `t` arrival time (Unix seconds),
  `end` finish time, `prompt` and `output` token counts, `keys` the prompt's chunk keys as one hex
  string (`key_bytes` leading bytes of each key, in prompt order; never token ids or text), `dkeys`
  the keys of the chunks its decode filled (stored, not looked up), `src`
  the prompt tokens by source (`device`, `host`, each tier by name, `recomputed`), `ttft` (null
  when unknown), `wait` the promotion wait in seconds, `lookup` the seconds from arrival to the
  lookup its blocks were allocated on (null: none), `st` the steps that completed its chunks as
  [seconds after arrival, chunks of `keys` + `dkeys` complete after that step] pairs (absent in
  older traces: read as one step at `ttft`, or at `lookup` if later, completing them all),
  `prio` the request's priority, `salt` a tag of its `cache_salt` (null without one): a hash keyed
  by a random key of the trace's writer, never written, so equal tags within one trace are one
  tenant while nobody can test a guessed salt against a tag or link tags across traces;
- a stored batch (`kvtier trace record` from vLLM's KV events): `t` and `keys` only; every key is a
  chunk the engine computed at `t`;
- a removal (KV events): `t` and `removed` (hex keys the engine evicted); counted, not analysed.

A key that repeats an earlier record's key is a reuse of that chunk. Keys chain over the whole
prefix, so a request's reused keys are a leading run of its keys.

The reader turns one or more files into flat numpy arrays (`Trace`); bad input raises `TraceError`
naming the file and line.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import KVTierError

FORMAT_VERSION = 1
KEY_BYTES = 8
SOURCES = ("connector", "kv_events")
NOT_BEYOND = ("device", "host", "recomputed")


class TraceError(KVTierError):
    """A trace cannot be read: the message names the file and line, or says the trace is empty."""


@dataclass(frozen=True)
class TraceHeader:
    """What a trace file says about the engine that recorded it."""

    source: str
    block_size: int
    blocks_per_chunk: int
    chunk_bytes: int | None
    key_bytes: int = KEY_BYTES

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    def to_json(self) -> str:
        """The header line (without newline)."""
        return json.dumps({
            "kvtier_trace": FORMAT_VERSION, "source": self.source, "block_size": self.block_size,
            "blocks_per_chunk": self.blocks_per_chunk, "chunk_bytes": self.chunk_bytes,
            "key_bytes": self.key_bytes,
        })


def encode_keys(keys: Iterable[bytes], key_bytes: int = KEY_BYTES) -> str:
    """The `keys` field: the leading `key_bytes` of each key, hex, concatenated."""
    return b"".join(k[:key_bytes] for k in keys).hex()


@dataclass
class Trace:
    """Records of one or more files, sorted by time (stable). Arrays are per record unless said.

    `refs` are the chunk references of every record in order (keys as uint64); record r's refs are
    `refs[starts[r]:starts[r] + counts[r]]`. `prompt` is 0 for stored batches of KV events."""

    header: TraceHeader
    t: np.ndarray
    prompt: np.ndarray
    priority: np.ndarray
    device: np.ndarray
    """Prompt tokens the engine's own prefix cache served (`src.device`; 0 when not recorded)."""
    ttft: np.ndarray
    """Seconds from arrival to the first token (`ttft`; 0 when not recorded)."""
    decode_counts: np.ndarray
    """Chunks each record's decode filled (`dkeys`); their keys are `decode_refs`, in order."""
    decode_refs: np.ndarray
    lookup: np.ndarray
    """Seconds from arrival to the lookup the request was served on (`lookup`; 0 when not
    recorded)."""
    finish: np.ndarray
    """Seconds from arrival to the request's end (`end`; when not recorded, its last step)."""
    host: np.ndarray
    """Prompt tokens the host tier served (`src.host`)."""
    beyond: np.ndarray
    """Prompt tokens the tiers beyond the host served (every `src` but device, host, recomputed)."""
    stepped: np.ndarray
    """Whether the record lists its steps (`st`); without them `stores` is one step at `ttft`."""
    stores: list[list[tuple[float, int]]]
    """Per record, the steps that completed its chunks: (seconds after arrival, chunks of its
    refs then decode refs complete after that step)."""
    starts: np.ndarray
    counts: np.ndarray
    refs: np.ndarray
    removals: int
    sources: dict[str, int]
    """Prompt tokens by source (`src`) summed over the request records."""

    @property
    def records(self) -> int:
        return len(self.t)


def _header(path: str, line: str) -> TraceHeader:
    try:
        raw = json.loads(line)
    except ValueError:
        raw = None
    if not isinstance(raw, dict) or "kvtier_trace" not in raw:
        raise TraceError(f"{path}:1: not a kvtier trace (the first line is not a trace header)")
    if raw["kvtier_trace"] != FORMAT_VERSION:
        raise TraceError(f"{path}:1: trace format {raw['kvtier_trace']!r}, this kvtier reads "
                         f"{FORMAT_VERSION}")
    try:
        header = TraceHeader(str(raw["source"]), int(raw["block_size"]),
                             int(raw["blocks_per_chunk"]),
                             None if raw.get("chunk_bytes") is None else int(raw["chunk_bytes"]),
                             int(raw.get("key_bytes", KEY_BYTES)))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{path}:1: bad trace header: {e!r}") from None
    if header.block_size < 1 or header.blocks_per_chunk < 1 or header.key_bytes != KEY_BYTES:
        raise TraceError(f"{path}:1: bad trace header: {line.strip()}")
    return header


class _Reader:
    """Accumulates the records of every file."""

    def __init__(self) -> None:
        self.header: TraceHeader | None = None
        self.t: list[float] = []
        self.prompt: list[int] = []
        self.priority: list[int] = []
        self.device: list[int] = []
        self.ttft: list[float] = []
        self.lookup: list[float] = []
        self.finish: list[float] = []
        self.host: list[int] = []
        self.beyond: list[int] = []
        self.stepped: list[bool] = []
        self.dkeys: list[bytes] = []
        self.stores: list[list[tuple[float, int]]] = []
        self.counts: list[int] = []
        self.keys: list[bytes] = []
        self.removals = 0
        self.sources: Counter[str] = Counter()

    def read(self, path: str) -> None:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
            if not first:
                return
            header = _header(path, first)
            if self.header is not None and header != self.header:
                raise TraceError(f"{path}:1: header {header} differs from the first file's "
                                 f"{self.header}: plan one engine's traces together")
            self.header = header
            for number, line in enumerate(f, 2):
                if not line.endswith("\n"):
                    raise TraceError(f"{path}:{number}: truncated record (no end of line)")
                self._record(path, number, line)

    def _record(self, path: str, number: int, line: str) -> None:
        try:
            raw = json.loads(line)
            if not isinstance(raw, Mapping):
                raise ValueError("not a JSON object")
            t = float(raw["t"])
            if "removed" in raw:
                self.removals += len(raw["removed"]) // (2 * KEY_BYTES)
                return
            keys = bytes.fromhex(raw["keys"])
            if len(keys) % KEY_BYTES:
                raise ValueError(f"keys is not a whole number of {KEY_BYTES}-byte keys")
            prompt = int(raw.get("prompt", 0))
            priority = int(raw.get("prio", 0))
            sources = {str(k): int(v) for k, v in raw.get("src", {}).items()}
            ttft = float(raw.get("ttft") or 0.0)
            lookup = float(raw.get("lookup") or 0.0)
            dkeys = bytes.fromhex(raw.get("dkeys", ""))
            if len(dkeys) % KEY_BYTES:
                raise ValueError(f"dkeys is not a whole number of {KEY_BYTES}-byte keys")
            chunks = (len(keys) + len(dkeys)) // KEY_BYTES
            steps = raw.get("st")
            stores = ([(max(ttft, lookup), chunks)] if steps is None
                      else [(float(dt), min(int(n), chunks)) for dt, n in steps])
            last = max([lookup, *(dt for dt, _ in stores)])
            finish = last if raw.get("end") is None else max(last, float(raw["end"]) - t)
        except (ValueError, KeyError, TypeError) as e:
            raise TraceError(f"{path}:{number}: not a trace record ({e!r})") from None
        self.t.append(t)
        self.prompt.append(prompt)
        self.priority.append(priority)
        self.device.append(sources.get("device", 0))
        self.ttft.append(ttft)
        self.lookup.append(lookup)
        self.finish.append(finish)
        self.host.append(sources.get("host", 0))
        self.beyond.append(sum(v for k, v in sources.items() if k not in NOT_BEYOND))
        self.stepped.append(steps is not None)
        self.dkeys.append(dkeys)
        self.stores.append(stores)
        self.counts.append(len(keys) // KEY_BYTES)
        self.keys.append(keys)
        self.sources.update(sources)

    def trace(self, paths: Sequence[str]) -> Trace:
        if self.header is None or not self.t:
            raise TraceError(f"empty trace: no records in {', '.join(paths)}")
        order = np.argsort(np.asarray(self.t, dtype=np.float64), kind="stable")
        counts = np.asarray(self.counts, dtype=np.int64)
        refs = np.frombuffer(b"".join(self.keys[i] for i in order), dtype=">u8").astype(np.uint64)
        sorted_counts = counts[order]
        sorted_starts = np.zeros(len(order), dtype=np.int64)
        np.cumsum(sorted_counts[:-1], out=sorted_starts[1:])
        return Trace(
            header=self.header, t=np.asarray(self.t, dtype=np.float64)[order],
            prompt=np.asarray(self.prompt, dtype=np.int64)[order],
            priority=np.asarray(self.priority, dtype=np.int64)[order],
            device=np.asarray(self.device, dtype=np.int64)[order],
            ttft=np.asarray(self.ttft, dtype=np.float64)[order],
            lookup=np.asarray(self.lookup, dtype=np.float64)[order],
            finish=np.asarray(self.finish, dtype=np.float64)[order],
            host=np.asarray(self.host, dtype=np.int64)[order],
            beyond=np.asarray(self.beyond, dtype=np.int64)[order],
            stepped=np.asarray(self.stepped, dtype=bool)[order],
            decode_counts=np.asarray([len(self.dkeys[i]) // KEY_BYTES for i in order], dtype=np.int64),
            decode_refs=np.frombuffer(b"".join(self.dkeys[i] for i in order), dtype=">u8").astype(np.uint64),
            stores=[self.stores[i] for i in order],
            starts=sorted_starts, counts=sorted_counts, refs=refs, removals=self.removals,
            sources=dict(self.sources),
        )


def read_traces(paths: Sequence[str | Path]) -> Trace:
    """Read and merge trace files (rotated parts of one trace, or several engines' traces with the
    same header). Raises TraceError for a missing, foreign, truncated or empty trace."""
    names = [str(p) for p in paths]
    reader = _Reader()
    for name in names:
        try:
            reader.read(name)
        except OSError as e:
            raise TraceError(f"{name}: cannot read: {e.strerror or e}") from None
    return reader.trace(names)
