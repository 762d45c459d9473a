"""The request trace's `salt` field: a tenant's requests share a tag within one trace, and the tag
is keyed per trace, so a reader of the file can neither test a guessed `cache_salt` against it nor
link the tenant across traces."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

from kvtier.engine.tracing import RequestTracer
from kvtier.trace.records import TraceHeader
from kvtier.trace.writer import TraceWriter


def traced(path: Path, salts: list[str | None]) -> list[dict[str, object]]:
    """The records a tracer writes to `path` for finished requests with `salts`."""
    tracer = RequestTracer(TraceWriter(str(path), TraceHeader("connector", 4, 1, 4096), 1 << 20), 4)
    for i, salt in enumerate(salts):
        request = SimpleNamespace(request_id=f"r{i}", arrival_time=1.0, num_prompt_tokens=9,
                                  num_output_tokens=1, cache_salt=salt)
        tracer.finished(request, [], {"recomputed": 9}, 50)  # type: ignore[arg-type]
    tracer.close()
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if '"salt"' in line]


def test_salt_tags_group_a_tenant_within_a_trace_and_nowhere_else(tmp_path: Path) -> None:
    first = traced(tmp_path / "a.jsonl", ["tenant-1", None, "tenant-1", "tenant-2"])
    tags = [r["salt"] for r in first]
    assert tags[0] == tags[2] and tags[1] is None and tags[3] not in (None, tags[0])
    guesses = {hashlib.sha256(b"tenant-1").hexdigest()[:16],
               hashlib.blake2b(b"tenant-1", digest_size=8).hexdigest()}
    assert tags[0] not in guesses
    again = traced(tmp_path / "b.jsonl", ["tenant-1"])
    assert again[0]["salt"] != tags[0]
