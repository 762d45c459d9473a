"""Where an engine step's time goes: `kvtier bench multiturn --mode inprocess` with every engine
step timed by phase.

    python -m benchmarks.bench_steps --out steps.json -- --preset cpu --conversations 16 \
        --configs host+fs,vllm-native+fs,all-fits --repeats 1

Everything after `--` goes to `kvtier bench multiturn` (`--mode inprocess` is added). vLLM's
scheduler (`schedule`, `update_from_output`) and kvtier's connector (`start_load_kv`,
`wait_for_save`, `get_num_new_matched_tokens`) are wrapped in this process before the first engine
starts, so each step records: its scheduled tokens, how many requests it starts (and their
tokens) and continues, the time of scheduling, of the forward pass (from the end of `schedule` to
`update_from_output`, kvtier's copies included) and of kvtier's calls. vLLM's own tiering does its
copies inside the forward pass and is not split out.

Prints per configuration the steps' total and percentiles, the phases' sums, the median forward
time by scheduled tokens, and the steps that both start a request and continue others ("mixed":
a decoding request waits for another's prefill there, which is what an inter-token p99 shows);
`--out` keeps the summaries as JSON (`--keep-steps`: every step too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.neutral_paths import neutral_argv

STEPS: list[dict[str, Any]] = []
"""One dict per engine step, and a {"config": ...} marker before each engine's steps."""
_current: dict[str, Any] = {}


def _install() -> None:
    """Wrap the scheduler's and the connector's methods (once per process)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtier.integrations.vllm.connector import KVTierConnector

    schedule, update = Scheduler.schedule, Scheduler.update_from_output

    def timed_schedule(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = schedule(self, *args, **kwargs)
        t1 = time.perf_counter()
        new = out.scheduled_new_reqs
        _current.clear()
        _current.update(
            start=t0, scheduled=t1, schedule_s=t1 - t0, tokens=out.total_num_scheduled_tokens,
            started=len(new), started_tokens=sum(out.num_scheduled_tokens[r.req_id] for r in new),
            continued=len(out.scheduled_cached_reqs.req_ids), load_s=0.0, save_s=0.0, lookup_s=0.0)
        return out

    def timed_update(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = update(self, *args, **kwargs)
        t1 = time.perf_counter()
        if _current:
            STEPS.append(dict(_current, forward_s=t0 - _current["scheduled"], update_s=t1 - t0,
                              step_s=t1 - _current["start"]))
        return out

    Scheduler.schedule, Scheduler.update_from_output = timed_schedule, timed_update  # type: ignore[method-assign]
    for method, phase in (("start_load_kv", "load_s"), ("wait_for_save", "save_s"),
                          ("get_num_new_matched_tokens", "lookup_s")):
        setattr(KVTierConnector, method, _timed(getattr(KVTierConnector, method), phase))


def _timed(fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _current[phase] = _current.get(phase, 0.0) + time.perf_counter() - t0
    return wrapper


def _hook_engines() -> None:
    """Install the wrappers when the first engine starts and mark where each engine's steps begin."""
    from kvtier.bench.multiturn import engine_run

    enter = engine_run.InProcessEngine.__enter__

    def marked_enter(self: engine_run.InProcessEngine) -> engine_run.InProcessEngine:
        if not STEPS:
            _install()
        s = self.settings
        kind = "kvtier" if s.kvtier else str((s.connector or {}).get("kv_connector", "vllm"))
        STEPS.append({"config": f"{kind}, {s.device_blocks} device blocks",
                      "secondary_tiers": len((s.kvtier or {}).get("secondary_tiers", []))})
        return enter(self)

    engine_run.InProcessEngine.__enter__ = marked_enter  # type: ignore[method-assign]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals, percentiles (ms), phase sums (s), forward ms by scheduled tokens, mixed steps."""
    work = [s for s in steps if s["tokens"] > 0]
    step_ms = [s["step_s"] * 1e3 for s in work]
    mixed = [s for s in work if s["started"] and s["continued"]]
    mixed_ms = [s["step_s"] * 1e3 for s in mixed]
    by_tokens: dict[int, list[float]] = {}
    for s in work:
        by_tokens.setdefault(min(s["tokens"] // 128, 8) * 128, []).append(s["forward_s"] * 1e3)
    return {
        "steps": len(work),
        "total_s": round(sum(step_ms) / 1e3, 2),
        "step_ms": {"p50": round(statistics.median(step_ms)), "p90": round(_pct(step_ms, 0.9)),
                    "p99": round(_pct(step_ms, 0.99)), "max": round(max(step_ms))},
        "phase_sums_s": {p: round(sum(s[p] for s in work), 2)
                         for p in ("schedule_s", "forward_s", "update_s", "load_s", "save_s", "lookup_s")},
        "forward_ms_by_tokens": {f">={k}": {"steps": len(v), "median": round(statistics.median(v))}
                                 for k, v in sorted(by_tokens.items())},
        "mixed_steps": len(mixed),
        "mixed_step_ms_median": round(statistics.median(mixed_ms)) if mixed_ms else None,
    }


def split(steps: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The steps of each engine, in the order the engines ran."""
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    for s in steps:
        if "config" in s:
            tiers = s["secondary_tiers"]
            name = s["config"] + (f" + {tiers} secondary tier(s)" if tiers else "")
            runs.append((name, []))
        elif runs:
            runs[-1][1].append(s)
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the summaries here (JSON)")
    p.add_argument("--keep-steps", action="store_true", help="with --out: every step too")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `kvtier bench multiturn` arguments")
    args = p.parse_args()
    bench = [a for a in args.bench if a != "--"]
    _hook_engines()
    from kvtier.cli import main as kvtier_main

    rc = kvtier_main(["bench", "multiturn", *bench, "--mode", "inprocess"])
    runs = [(name, summarize(steps), steps) for name, steps in split(STEPS) if steps]
    for name, summary, _ in runs:
        print(f"== {name}", file=sys.stderr)
        print(json.dumps(summary, indent=1), file=sys.stderr)
    if args.out:
        kept = [{"engine": n, "summary": s, **({"steps": st} if args.keep_steps else {})}
                for n, s, st in runs]
        doc = {"command": neutral_argv(sys.argv), "runs": kept}
        args.out.write_text(json.dumps(doc))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
