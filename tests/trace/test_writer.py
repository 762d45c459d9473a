"""The background trace writer: records in order, rotation, resuming, a full disk, a stalled file."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from kvtier.trace.records import TraceHeader, read_traces
from kvtier.trace.writer import TraceWriter

HEADER = TraceHeader("connector", 16, 1, 1000)


def record(i: int) -> dict:
    return {"t": float(i), "keys": (i % 7).to_bytes(8, "big").hex() * 3, "prompt": 48, "prio": 0}


def test_records_rotate_and_every_part_reads(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(path, HEADER, max_bytes=4096)
    for i in range(200):
        assert writer.write(record(i))
    writer.close()
    writer.close()
    assert (writer.written, writer.dropped, writer.failed) == (200, 0, False)
    rotated = Path(f"{path}.1")
    assert path.stat().st_size < 4096 + 200 and rotated.stat().st_size >= 4096
    both = read_traces([rotated, path])
    assert both.records < 200  # the older rotations are gone: the trace stays bounded
    assert list(both.t) == sorted(both.t) and both.t[-1] == 199.0
    assert read_traces([path]).header == HEADER


def test_resumes_its_own_trace_and_moves_a_foreign_file_aside(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    for start in (0, 10):
        writer = TraceWriter(path, HEADER, max_bytes=1 << 20)
        for i in range(start, start + 10):
            writer.write(record(i))
        writer.close()
    assert list(read_traces([path]).t) == [float(i) for i in range(20)]
    other = TraceWriter(path, TraceHeader("connector", 32, 1, 2000), max_bytes=1 << 20)
    other.write(record(99))
    other.close()
    assert read_traces([f"{path}.1"]).records == 20
    assert list(read_traces([path]).t) == [99.0]


def test_full_disk_stops_tracing_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.trace"):
        writer = TraceWriter("/dev/full", HEADER, max_bytes=1 << 20)
        writer.write(record(0))
        deadline = time.monotonic() + 10
        while not writer.failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.failed
        assert not writer.write(record(1))
        writer.close()
    warnings = [r for r in caplog.records if "tracing stopped" in r.getMessage()]
    assert len(warnings) == 1 and "/dev/full" in warnings[0].getMessage()


def test_a_stalled_file_never_blocks_the_caller(tmp_path: Path) -> None:
    fifo = tmp_path / "stalled"
    os.mkfifo(fifo)  # opening it for writing blocks until a reader comes: a stalled file system
    writer = TraceWriter(fifo, HEADER, max_bytes=1 << 20, queue_records=10)
    # Every call returns while the writer thread is stalled (no reader has opened the FIFO yet):
    # the queue takes 10 records and the rest are dropped, never waited for.
    accepted = [writer.write(record(i)) for i in range(100)]
    assert accepted.count(True) == 10 and writer.dropped == 90
    assert writer.written == 0  # nothing reached the file: the writer thread is still stalled
    lines: list[str] = []

    def read() -> None:
        with open(fifo, encoding="utf-8") as f:
            lines.extend(f)

    reader = threading.Thread(target=read)
    reader.start()
    writer.close()
    reader.join(10)
    assert len(lines) == 11 and lines[0].startswith('{"kvtier_trace"')


def test_trace_config_keys_are_checked() -> None:
    from kvtier.config import KVTierConfig
    from kvtier.errors import ConfigError

    config = KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20, "trace_path": "/tmp/t.jsonl"})
    assert (config.trace_path, config.trace_max_bytes) == ("/tmp/t.jsonl", 256 << 20)
    with pytest.raises(ConfigError, match="trace_max_bytes = 10 is invalid"):
        KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20, "trace_max_bytes": 10})
    with pytest.raises(ConfigError, match="trace_path = ''"):
        KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20, "trace_path": ""})
