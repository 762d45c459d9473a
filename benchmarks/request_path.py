"""How many of kvtier's source files one request crosses, from the engine's lookup to a tier
process and back, for a prefix only the fs tier holds.

    python -m benchmarks.request_path [--json OUT]

A tiny model's prompt is computed, stored to the host tier and cascaded to an fs tier (a real
tier process over a temp directory); the host tier is emptied; then a new request with the same
prompt is looked up, step by step as an engine would (lookup, then the step's plan), until its
tokens are offered. Every function call in that window is recorded, in the engine process with a
profiler and in the tier process through a `sitecustomize` that this script puts on the child's
PYTHONPATH (SIGUSR1 starts its window, SIGUSR2 writes the files it saw). It prints the files and
folders of each process, and the file-to-file hops of the engine side's call sequence. The
connector (`integrations/vllm/connector.py`) dispatches each hook to the planner: it is counted
as one more file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvtier"
SITE = '''
import os, signal, sys, threading
if os.environ.get("KVTIER_PATH_OUT"):
    seen, on = set(), [False]
    def prof(frame, event, arg):
        if on[0] and event == "call":
            seen.add(frame.f_code.co_filename)
    def start(*_):
        seen.clear(); on[0] = True
    def stop(*_):
        on[0] = False
        with open(os.environ["KVTIER_PATH_OUT"] + ".tmp", "w") as f:
            f.write("\\n".join(sorted(seen)))
        os.replace(os.environ["KVTIER_PATH_OUT"] + ".tmp", os.environ["KVTIER_PATH_OUT"])
    signal.signal(signal.SIGUSR1, start); signal.signal(signal.SIGUSR2, stop)
    sys.setprofile(prof); threading.setprofile(prof)
'''


def kvtier_files(paths: list[str]) -> list[str]:
    """Package-relative paths of the kvtier sources among `paths`."""
    out = {str(Path(p).resolve().relative_to(PACKAGE)) for p in paths
           if Path(p).resolve().is_relative_to(PACKAGE)}
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtier-path-"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITE)
    out = work / "tier-files.txt"
    os.environ["KVTIER_PATH_OUT"] = str(out)
    sys.path[:0] = [str(work / "site"), str(ROOT)]  # tier processes inherit sys.path
    from kvtier.config import KVTierConfig
    from kvtier.engine.planner import Planner
    from kvtier.engine.step import CopyReport
    from tests.engine.fakes import ROW_BYTES, FakeRequest, geometry

    prompt = list(range(100, 114))
    config = KVTierConfig.from_dict({
        "cpu_bytes_to_use": 8 * ROW_BYTES,
        "secondary_tiers": [{"type": "fs", "root_dir": str(work / "fs")}],
    })
    planner = Planner(config, geometry(), 1)
    blocks = {"a": [4, 1, 2, 3], "b": [10, 11, 12, 13]}
    planner.bind_block_ids(lambda req_id: (blocks[req_id],))
    first = FakeRequest("a", prompt)
    planner.lookup(first, 0)
    plan = planner.step({"a": len(prompt)})
    first.num_computed_tokens = len(prompt)
    planner.copies_done(CopyReport({job.job_id: (1, True) for job in plan.stores}))
    planner.finished(first)
    manager = planner.manager
    deadline = time.monotonic() + 30
    while manager.in_flight and time.monotonic() < deadline:
        manager.poll()
        time.sleep(0.01)
    manager.clear_host()
    tier = manager.tiers["fs"]
    pid = tier._gen.proc.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGUSR1)
    time.sleep(0.2)

    calls: list[str] = []

    def prof(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(frame.f_code.co_filename)

    again = FakeRequest("b", prompt)
    sys.setprofile(prof)
    threading.setprofile(prof)
    steps = 0
    while True:
        tokens, _ = planner.lookup(again, 0)
        if tokens:
            break
        planner.step({})
        steps += 1
        time.sleep(0.001)
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    os.kill(pid, signal.SIGUSR2)
    while not out.exists():
        time.sleep(0.01)
    engine_seq = [str(Path(c).resolve().relative_to(PACKAGE)) for c in calls
                  if Path(c).resolve().is_relative_to(PACKAGE)]
    hops = sum(1 for a, b in itertools.pairwise(engine_seq) if a != b)
    engine = sorted({*engine_seq, "integrations/vllm/connector.py"})
    tier_files = kvtier_files(out.read_text().split())
    every = sorted({*engine, *tier_files})
    folders = sorted({str(Path(f).parent) for f in every})
    planner.shutdown()
    result = {"tokens_offered": tokens, "steps_until_offered": steps, "engine_files": engine,
              "tier_process_files": tier_files, "files": len(every), "folders": len(folders),
              "engine_side_hops": hops}
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}))
    print("engine:", ", ".join(engine))
    print("tier process:", ", ".join(tier_files))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
