"""The plan's verdict: "offload", "offload with admission", or "will not help", with its reason:
the operator guide's cases where offloading is the wrong optimization, checked on the trace.

"will not help" when the first of these holds, in this order:

1. prompts mostly unique: under `MIN_REUSABLE` (10%) of the prompt tokens repeat an earlier
   prefix (`reusable_token_fraction`). Even a host tier that keeps everything would save under a
   tenth of the prefill, while it copies every chunk to the host.
2. transfer time above recompute time: loading one chunk of the trace (`chunk_bytes` at the host
   transfer budget) does not pay against recomputing its tokens at the prefill rate: the rule of
   the engine's `load_policy: auto` (`kvtier.policies.load_rule`: a load pays only under 0.9x the
   recompute time), so the plan recommends no offload the engine would decline. The rate is
   `--prefill-tok-s`, else the trace's recomputed tokens over the TTFTs of the requests that
   loaded nothing (`prefill_tokens_per_s`); a TTFT also holds queueing and the first decode step,
   so that rate is a lower bound and the rule fires only where loading is slower still. Not
   checked when neither says the rate (a kv-events trace has no TTFT).
3. reuse times beyond what the recommended size holds: the host tier of `cpu_bytes_to_use`, with
   the better of `all` and `frequency` admission (probation, `probation.py`), serves under
   `MIN_SERVED` (half) of the reachable reuse: the median reuse comes after the host evicted the
   chunk. `cpu_bytes_to_use` captures 90% of it unless `--host-bytes` caps it, so this rule fires
   only where the host memory an operator can give is too small for the reuse times.

Otherwise "offload with admission" when `frequency` admission at its best `min_seen` serves at
least `ADMISSION_GAIN` (5 points) more of the references than `all` at the recommended size (one-off
prompts would push reused prefixes out; probation evicts them first): 5 points is the accuracy
asked of the plan's predictions, so a smaller gain is within their error. Else "offload".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.policies.load_rule import MARGIN, load_pays
from kvtier.trace.probation import HostRun
from kvtier.trace.records import Trace

OFFLOAD = "offload"
WITH_ADMISSION = "offload with admission"
NO_HELP = "will not help"
UNIQUE = "prompts mostly unique"
TRANSFER = "transfer time above recompute time"
BEYOND = "reuse times beyond what the recommended size holds"
MIN_REUSABLE = 0.10
MIN_SERVED = 0.5
ADMISSION_GAIN = 0.05
GIB = 1 << 30


def prefill_tokens_per_s(trace: Trace) -> float | None:
    """Recomputed prompt tokens per second of TTFT over the requests that loaded nothing (no host
    or tier tokens) and record a TTFT; None when there are none."""
    recomputed = trace.prompt - trace.device - trace.host - trace.beyond
    quiet = (trace.prompt > 0) & (trace.host == 0) & (trace.beyond == 0) & (trace.ttft > 0) & (
        recomputed > 0)
    seconds = float(trace.ttft[quiet].sum())
    return float(recomputed[quiet].sum()) / seconds if seconds > 0 else None


@dataclass(frozen=True)
class Evidence:
    """What the verdict weighs. `runs`: the host tier of `host_bytes` (the recommended size) under
    `frequency` admission, `min_seen` 1 (every chunk settled: `all`) first."""

    reusable_token_fraction: float
    chunk_bytes: int
    chunk_tokens: int
    host_bytes_per_s: float
    prefill_tokens_per_s: float | None
    host_bytes: int
    reachable_hit_ratio: float
    reuse_gap_p50_s: float | None
    runs: Sequence[HostRun]

    @property
    def best(self) -> HostRun:
        """The `frequency` run (`min_seen` > 1) that serves the most, the lowest `min_seen` of
        equals."""
        return max(self.runs[1:], key=lambda r: r.hits)


def decide(e: Evidence) -> dict[str, Any]:
    """`verdict`, `verdict_reason` (a sentence that starts with the rule that decided) and
    `verdict_checks` (each rule's figures and threshold)."""
    load_ms = 1000.0 * e.chunk_bytes / e.host_bytes_per_s
    rate = e.prefill_tokens_per_s
    recompute_ms = 1000.0 * e.chunk_tokens / rate if rate else None
    everything, best = e.runs[0], e.best
    hit = max(everything.hit_ratio, best.hit_ratio)
    served = hit / e.reachable_hit_ratio if e.reachable_hit_ratio > 0 else 0.0
    gain = best.hit_ratio - everything.hit_ratio
    holding = (best if best.hit_ratio > everything.hit_ratio else everything).holding_s
    checks = {
        "reusable_token_fraction": e.reusable_token_fraction, "min_reusable_token_fraction": MIN_REUSABLE,
        "load_ms_per_chunk": load_ms, "recompute_ms_per_chunk": recompute_ms, "load_margin": MARGIN,
        "prefill_tokens_per_s": rate, "host_bytes": e.host_bytes, "host_hit_ratio": hit,
        "reuse_served_fraction": served, "min_reuse_served_fraction": MIN_SERVED,
        "reuse_gap_p50_s": e.reuse_gap_p50_s, "holding_s": holding,
        "admission_min_seen": best.min_seen, "admission_gain": gain, "min_admission_gain": ADMISSION_GAIN,
    }
    size = f"a host tier of {_bytes(e.host_bytes)}"
    if e.reusable_token_fraction < MIN_REUSABLE:
        return _verdict(NO_HELP, f"{UNIQUE}: {e.reusable_token_fraction:.1%} of the prompt tokens "
                        f"repeat an earlier prefix, under {MIN_REUSABLE:.0%}", checks)
    if recompute_ms is not None and not load_pays(load_ms, recompute_ms):
        return _verdict(NO_HELP, f"{TRANSFER}: loading a chunk of {e.chunk_bytes} bytes takes "
                        f"{load_ms:.3g} ms at {e.host_bytes_per_s / GIB:.3g} GiB/s, recomputing its "
                        f"{e.chunk_tokens} tokens {recompute_ms:.3g} ms at {rate:.0f} tokens/s (a "
                        f"load pays under {MARGIN:.0%} of it)", checks)
    if served < MIN_SERVED:
        return _verdict(NO_HELP, f"{BEYOND}: {size} serves {served:.0%} of the reachable reuse, under "
                        f"{MIN_SERVED:.0%}; reuses come {_s(e.reuse_gap_p50_s)} (p50) after the "
                        f"chunk's previous use, it keeps an unused chunk {_s(holding)}", checks)
    if gain >= ADMISSION_GAIN:
        return _verdict(WITH_ADMISSION, f"{size} with frequency admission (admission_min_seen "
                        f"{best.min_seen}) serves {best.hit_ratio:.1%} of the chunk references, "
                        f"{everything.hit_ratio:.1%} admitting all: one-off prompts wait on "
                        "probation and leave first", checks)
    timing = ("recompute time unknown (no TTFT in the trace: --prefill-tok-s)" if recompute_ms is None
              else f"a load takes {load_ms:.3g} ms per chunk, a recompute {recompute_ms:.3g} ms")
    return _verdict(OFFLOAD, f"{size} serves {hit:.1%} of the chunk references ({served:.0%} of the "
                    f"reachable reuse); {timing}", checks)


def _bytes(n: int) -> str:
    for unit, name in ((GIB, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.3g} {name}"
    return f"{n} bytes"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3g} s"


def _verdict(verdict: str, reason: str, checks: dict[str, Any]) -> dict[str, Any]:
    return {"verdict": verdict, "verdict_reason": reason, "verdict_checks": checks}

