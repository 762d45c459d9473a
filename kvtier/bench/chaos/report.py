"""The campaign's verdict: a summary of a run's raw results, the pass rule, and a table.

- wrong replies: finished requests whose token ids differ from the reference (must be 0);
- failed or hung: requests the engine failed or that did not finish in time (must be 0);
- corruptions: injected, and the ledger's outcome of each (`ledger.OUTCOMES`); `detected` is what
  kvtier's own metric (`kvtier_bad_chunks_total`) counted, `read` what the ledger saw the tiers
  encounter (detected + served); served must be 0 and detected must equal read;
- faults: each process fault kind, how many ran and how many the run survived;
- p99 TTFT of requests whose first token overlapped a process fault, against the others;
- recovery: after each restart (tier process killed, redis or SeaweedFS restarted), seconds until
  the tier served a promotion again (null: not within the run);
- the host tier clean (`check()`) with no pinned row, no temp file left in the fs tier;
- per tier: corruptions injected, detected (the ledger; kvtier's metric beside it), served, the
  wrong replies among requests that loaded from it, and its outages (the process faults that hit
  it); with `min_detected`, each of those tiers must have detected at least that many;
- soak: each resource's growth after the warm-up (must stay under 5 %).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvtier.bench.chaos.driver import Outcome
from kvtier.bench.chaos.runner import outcome_during
from kvtier.bench.multiturn.summary import percentile

RESTARTS = ("tier_kill", "redis_restart", "seaweed_restart", "cluster_restart", "peer_restart")
GROWTH_LIMIT = 0.05


def _p99(values: list[float]) -> float | None:
    return round(percentile(values, 99), 3) if values else None


def per_tier(raw: dict[str, Any], outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Per secondary tier: injected, detected (ledger), counted (metric), served, wrong replies of
    requests that loaded from it, requests that did, its outages by kind, and its successful loads
    while one of them lasted (a cluster node down: the other nodes serve)."""
    ledger = raw["ledger"]
    by_tier = ledger.get("outcomes_by_tier", {})
    out: dict[str, dict[str, Any]] = {}
    for tier in raw["detected_metric"]:
        loaded = [o for o in outcomes if o.tokens.get(tier, 0) > 0 and not o.hung and o.failed is None]
        windows = [w for w in raw["windows"] if w["target"] == tier]
        outages = Counter(w["kind"] for w in windows)
        during = sum(any(w["start"] <= t <= w["end"] for w in windows) for t in raw["loads_ok"].get(tier, ()))
        out[tier] = {
            "injected": ledger["by_tier"].get(tier, 0), "detected": by_tier.get(tier, {}).get("detected", 0),
            "counted": raw["detected_metric"][tier], "served": by_tier.get(tier, {}).get("served", 0),
            "requests_loading": len(loaded), "wrong_replies": sum(not o.ok for o in loaded),
            "outages": dict(outages), "loads_during_outages": during,
        }
    return out


def summarize(raw: dict[str, Any], *, expect_corruptions: bool, soak: bool,
              min_detected: dict[str, int] | None = None) -> dict[str, Any]:
    outcomes = [Outcome(**o) for o in raw["outcomes"]]
    windows = raw["windows"]
    finished = [o for o in outcomes if not o.hung and o.failed is None]
    wrong = sum(not o.ok for o in finished)
    bad = sum(o.hung or o.failed is not None for o in outcomes)
    during = [o.ttft for o in finished if o.ttft is not None and outcome_during(o, windows)]
    calm = [o.ttft for o in finished if o.ttft is not None and not outcome_during(o, windows)]
    ledger = raw["ledger"]
    outcomes_by = ledger["outcomes"]
    detected = sum(raw["detected_metric"].values())
    read = outcomes_by["detected"] + outcomes_by["served"]
    faults: dict[str, dict[str, int]] = {}
    for w in windows:
        entry = faults.setdefault(w["kind"], {"ran": 0, "survived": 0})
        entry["ran"] += 1
        entry["survived"] += int(w["ok"])
    recovery = []
    for w in windows:
        if w["kind"] in RESTARTS and w["ok"]:
            after = [t for t in raw["loads_ok"].get(w["target"], ()) if t > w["end"]]
            recovery.append({"kind": w["kind"], "target": w["target"],
                             "seconds": round(min(after) - w["end"], 2) if after else None})
    tokens: Counter[str] = Counter()
    for o in outcomes:
        tokens.update(o.tokens)
    growth = raw.get("growth") or {}
    checks = {
        "wrong_replies": wrong == 0,
        "failed_or_hung": bad == 0,
        "served": outcomes_by["served"] == 0,
        # An injection that raised (a server restarting) may still have landed untracked: kvtier
        # may detect up to that many more than the ledger saw read, never fewer.
        "every_read_detected": read <= detected <= read + sum(raw["failed_injections"].values()),
        "host_clean": raw["host"]["check"] == "clean" and raw["host"]["pinned"] == 0,
        "temps_cleaned": raw["temps_remaining"] == 0,
    }
    if expect_corruptions:
        checks["injected"] = ledger["injected"] > 0
    tiers = per_tier(raw, outcomes)
    if min_detected:
        checks["detected_per_tier"] = all(tiers.get(t, {}).get("detected", 0) >= n
                                          for t, n in min_detected.items())
    if soak:
        checks["flat_resources"] = all(g is not None and g < GROWTH_LIMIT for g in growth.values())
    return {
        "passed": all(checks.values()), "checks": checks, "seconds": raw["seconds"],
        "requests": len(outcomes), "rounds": 1 + max((o.round for o in outcomes), default=-1),
        "wrong_replies": wrong, "failed_or_hung": bad,
        "corruptions": {"injected": ledger["injected"], "detected": detected, "read": read,
                        "served": outcomes_by["served"], "outcomes": outcomes_by,
                        "by_kind": ledger["by_kind"], "by_tier": ledger["by_tier"],
                        "detected_by_tier": raw["detected_metric"],
                        "failed_injections": raw["failed_injections"]},
        "faults": faults, "tiers": tiers,
        "ttft_p99_s": {"during_faults": _p99(during), "without": _p99(calm),
                       "requests_during": len(during), "requests_without": len(calm)},
        "recovery": recovery, "prompt_tokens": dict(tokens),
        "host": raw["host"], "temps": {"left": raw["temps_left"], "remaining": raw["temps_remaining"]},
        "fsck": raw["fsck"], "tier_restarts": raw["tier_restarts"], "growth": growth,
        "notes": raw["notes"],
    }


def table(s: dict[str, Any]) -> str:
    c = s["corruptions"]
    failed = ", ".join(k for k, v in s["checks"].items() if not v)
    survived = ", ".join(f"{k} {v['survived']}/{v['ran']}" for k, v in s["faults"].items())
    rows = [
        ("verdict", "PASS" if s["passed"] else f"FAIL: {failed}"),
        ("requests (rounds)", f"{s['requests']} ({s['rounds']})"),
        ("wrong replies", s["wrong_replies"]),
        ("failed or hung requests", s["failed_or_hung"]),
        ("corruptions injected", c["injected"]),
        ("  detected (kvtier metric) / read", f"{c['detected']} / {c['read']}"),
        ("  served", c["served"]),
        ("  outcomes", ", ".join(f"{k} {v}" for k, v in c["outcomes"].items())),
        ("  by kind", ", ".join(f"{k} {v}" for k, v in sorted(c["by_kind"].items()))),
        ("  by tier", ", ".join(f"{k} {v}" for k, v in sorted(c["by_tier"].items()))),
        ("faults survived", survived or "-"),
        ("p99 TTFT during faults / without (s)",
         f"{s['ttft_p99_s']['during_faults']} / {s['ttft_p99_s']['without']}"),
        ("recovery after restarts (s)",
         ", ".join(f"{r['kind']}:{r['target']} {r['seconds']}" for r in s["recovery"]) or "-"),
        ("prompt tokens by source", ", ".join(f"{k} {v}" for k, v in sorted(s["prompt_tokens"].items()))),
        ("host tier", f"check {s['host']['check']}, pinned {s['host']['pinned']}"),
        ("fs temp files left / remaining", f"{s['temps']['left']} / {s['temps']['remaining']}"),
        ("seconds", s["seconds"]),
    ]
    if s["growth"]:
        rows.append(("growth after warm-up", ", ".join(
            f"{k} {'-' if v is None else f'{100 * v:+.1f}%'}" for k, v in s["growth"].items())))
    width = max(len(str(k)) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if s.get("tiers"):
        lines += ["", "tier      injected  detected  counted  served  wrong/loading  outages (loads during)"]
        for tier, t in s["tiers"].items():
            outages = ", ".join(f"{k} {v}" for k, v in sorted(t["outages"].items())) or "-"
            lines.append(f"{tier:<8}  {t['injected']:>8}  {t['detected']:>8}  {t['counted']:>7}  "
                         f"{t['served']:>6}  {t['wrong_replies']:>5}/{t['requests_loading']:<7}  {outages}"
                         f" ({t['loads_during_outages']})")
    return "\n".join(lines)
