"""One chaos run: servers, the fs tier's small filesystem, the kvtier engine with host + the
preset's secondary tiers (fs, obj, redis, the cluster, p2p), the injectors, the load, and the
checks at the end.

Order: the reference (cached, or built on an engine without kvtier), then redis-server, SeaweedFS
and the Valkey Cluster, a tmpfs for the fs tier (ENOSPC is skipped when it cannot be mounted), the engine with
every secondary tier's handle wrapped in a `TierSpy`, the p2p peer (fed from the fs tier by the
injectors), the injectors and the sampler; the load
(`driver.drive`) runs until the preset's stop rule. Then the injectors stop, the tiers settle, the
tiers' bad-chunk counts reach kvtier's metrics, the ledger is reconciled with the media, the host
tier is checked, `kvtier fsck` reads the fs tier, and everything is torn down in reverse order.
`run` returns the raw results (`report` turns them into JSON and a table).
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

from kvtier.bench.chaos.corrupt import WRONG_SIZE
from kvtier.bench.chaos.driver import Outcome, drive
from kvtier.bench.chaos.faults import Injectors, Targets
from kvtier.bench.chaos.ledger import Ledger, TierSpy
from kvtier.bench.chaos.media import ClusterMedium, FsMedium, Medium, ObjMedium, RedisMedium
from kvtier.bench.chaos.peer import Peer, PeerMedium, peer_address
from kvtier.bench.chaos.peer import tier_options as p2p_options
from kvtier.bench.chaos.presets import ChaosPreset
from kvtier.bench.chaos.reference import Reference
from kvtier.bench.chaos.sampler import Sampler, as_json, growth
from kvtier.bench.chaos.services import Redis, Seaweed
from kvtier.bench.chaos.valkey_cluster import Cluster
from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.bench.neutral_paths import neutral_path

BLOCK = 32
PREFIX = "chaos"


@contextlib.contextmanager
def tmpfs(path: Path, mib: int) -> Iterator[bool]:
    """A tmpfs of `mib` MiB at `path` for the block; False (a plain directory) when not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                          capture_output=True, check=False)
    try:
        yield done.returncode == 0
    finally:
        if done.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def _settle(manager: Any, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while manager.in_flight and time.monotonic() < deadline:
        manager.poll()
        time.sleep(0.02)
    return not manager.in_flight


def _flush_counts(scheduler: Any) -> None:
    """Ask every tier for its counters now and pass them to the metrics (one scheduler step)."""
    for tier in scheduler.manager.tiers.values():
        if tier.is_up:
            tier.request_stats()
    time.sleep(1.0)
    scheduler.manager.poll()
    scheduler.ops.step([])


def _bad_chunks(manager: Any) -> dict[str, int]:
    """Bad chunks by tier, every reason together, as kvtier's metrics counted them."""
    return {name: int(manager.metrics.tier_counts(name).bad_chunks) for name in manager.tiers}


def run(preset: ChaosPreset, model: Path, work: Path, seed: int = 0) -> dict[str, Any]:
    from vllm import LLM

    from kvtier.integrations.vllm.serving.launch import transfer_config

    spec, dtype = preset.spec, "float32"
    max_model_len = -(-(spec.max_prompt_tokens(16) + spec.output_tokens + BLOCK) // BLOCK) * BLOCK
    ref = Reference.load_or_build(model, dtype, spec, max_model_len,
                                  {"block_size": BLOCK, "kv_cache_memory_bytes": 256 << 20,
                                   "max_num_seqs": spec.conversations})
    row_bytes = kv_bytes_per_token(model, dtype) * BLOCK
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        redis = Redis(work / "redis")
        redis.start()
        stack.callback(redis.kill)
        cluster = None
        if "cluster" in preset.tiers:
            cluster = Cluster(work / "cluster")
            stack.callback(cluster.stop)
            cluster.start(wait=False)
        seaweed = Seaweed(work / "seaweedfs")
        seaweed.start()
        stack.callback(seaweed.kill)
        if cluster is not None:
            cluster.wait_ready()
        mount = work / "fs-mnt"
        mounted = stack.enter_context(tmpfs(mount, preset.fs_mib))
        if not mounted:
            notes.append("tmpfs not permitted: the fs tier is on the work directory, no ENOSPC fault")
        fs_root = mount / "fs"
        fs_root.mkdir(parents=True, exist_ok=True)
        secret, address = secrets.token_hex(16), peer_address()
        configs = {
            "fs": {"type": "fs", "root_dir": str(fs_root), "rescan_interval_s": 2.0, "temp_grace_s": 5.0},
            "obj": {"type": "obj", "prefix": PREFIX, **seaweed.tier_options()},
            "redis": {"type": "redis", "url": redis.url, "key_prefix": PREFIX},
            "cluster": {"type": "redis", "name": "cluster", "urls": cluster.urls if cluster else [],
                        "key_prefix": PREFIX},
            "p2p": {"type": "p2p", **p2p_options(address, secret)},
        }
        tiers = [configs[name] for name in preset.tiers]
        extra = {"cpu_bytes_to_use": preset.host_chunks * row_bytes, "eviction_policy": "lru",
                 "secondary_tiers": tiers, "tier_restart_backoff_s": 0.5, "tier_job_timeout_s": 20.0}
        llm: Any = LLM(model=str(model), dtype=cast(Any, dtype), enforce_eager=True, block_size=BLOCK,
                  num_gpu_blocks_override=preset.device_blocks,
                  kv_cache_memory_bytes=(preset.device_blocks + 1) * row_bytes,
                  max_model_len=max_model_len, max_num_seqs=spec.max_concurrency, seed=0,
                  kv_transfer_config=transfer_config(extra))
        stack.callback(llm.llm_engine.engine_core.shutdown)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.planner
        manager = scheduler.manager
        fp, host_row = manager.tiers["fs"].spec.layout_fingerprint, manager.tiers["fs"].spec.row_bytes
        fs = FsMedium("fs", fp, fs_root)
        media: dict[str, Medium] = {
            "fs": fs, "obj": ObjMedium("obj", fp, seaweed.client(), seaweed.bucket, PREFIX),
            "redis": RedisMedium("redis", fp, redis.client(), PREFIX)}
        if cluster is not None:
            media["cluster"] = ClusterMedium("cluster", fp, cluster, PREFIX)
        peer = None
        if "p2p" in preset.tiers:
            slots = spec.conversations * -(-ref.longest // BLOCK) + 16
            holder = Peer(address, host_row, slots, fp, secret)
            stack.callback(holder.close)
            holder.start()
            peer = PeerMedium("p2p", fp, holder)
            media["p2p"] = peer
        media = {name: m for name, m in media.items() if name in preset.tiers}
        ledger = Ledger(lambda tier, key: media[tier].verify(key),
                        lambda tier, key: peer.repair(key) if peer is not None and tier == "p2p" else None)
        for name in list(manager.tiers):
            manager.tiers[name] = TierSpy(manager.tiers[name], ledger, refusals=name == "p2p",
                                          removed_at_start=WRONG_SIZE if name == "fs" else frozenset())
        injectors = None
        if preset.pace is not None:
            targets = Targets(list(media.values()), lambda: dict(manager.tiers), redis, seaweed,
                              mount if mounted else None, fs, cluster=cluster, peer=peer)
            injectors = Injectors(targets, ledger, preset.pace, seed)
        sampler = None
        if preset.sample_every_s is not None:
            sampler = Sampler(preset.sample_every_s)
            sampler.start()
        started = time.monotonic()

        def keep_going(rnd: int) -> bool:
            if rnd + 1 >= preset.max_rounds:
                return False
            if preset.duration_s is not None:
                return True
            if preset.max_s is not None and time.monotonic() - started >= preset.max_s:
                return False
            injected = ledger.counts()["injected"]
            return (rnd + 1 < preset.min_rounds or injected < preset.min_corruptions
                    or (injectors is not None and not injectors.every_fault_ran())
                    or any(ledger.detected(t) < preset.min_detected for t in preset.detect_tiers))

        def stop() -> bool:
            return preset.duration_s is not None and time.monotonic() - started >= preset.duration_s

        if injectors is not None:
            injectors.start()
        try:
            rotation = [(name,) for name in preset.load_rotation]
            outcomes = drive(llm.llm_engine, ref, spec.max_concurrency, keep_going, preset.hang_s, stop,
                             load_tiers=rotation)
        finally:
            if injectors is not None:
                injectors.stop()
            if sampler is not None:
                sampler.stop()
        took = time.monotonic() - started
        # Warm-up: the preset's, or until every conversation was stored once (its first round).
        first_round = max((o.end or 0.0 for o in outcomes if o.round == 0), default=started)
        warm_up = max(preset.warm_up_s, first_round - (sampler.t0 if sampler else started))
        settled = _settle(manager)
        _flush_counts(scheduler)
        ledger.reconcile()
        temps = _wait_temps(fs, 15.0)
        host = manager.host.stats()
        host_error = None
        try:
            manager.host.check()
        except Exception as e:
            host_error = f"{type(e).__name__}: {e}"
        from kvtier.tiers.fs.fsck import fsck

        fsck_report = fsck(str(fs_root), False, temp_grace_s=5.0)
        result = {
            "seconds": round(took, 1), "notes": notes, "row_bytes": row_bytes,
            "outcomes": [asdict(o) for o in outcomes],
            "windows": [asdict(w) for w in (injectors.windows if injectors else [])],
            "failed_injections": dict(injectors.failed_injections) if injectors else {},
            "temps_left": injectors.temps_left if injectors else 0, "temps_remaining": len(temps),
            "ledger": ledger.counts(), "detected_metric": _bad_chunks(manager),
            "served": [{"tier": c.tier, "key": c.key.hex(), "kind": c.kind, "start": c.start, "at": c.at}
                       for c in ledger.settled if c.outcome == "served"],
            "loads_ok": ledger.loads_ok, "settled": settled,
            "host": {"pinned": host.pinned, "check": host_error or "clean"},
            "fsck": {**_fsck_json(fsck_report), "root": neutral_path(str(fs_root))},
            "tier_restarts": {t.name: t.restarts for t in manager.tiers.values()},
            "samples": as_json(sampler.samples) if sampler else [],
            "warm_up_s": warm_up, "growth": growth(sampler.samples, warm_up) if sampler else {},
            "started_mono": started,
        }
    return result


def _wait_temps(fs: FsMedium, timeout_s: float) -> list[Path]:
    """The temp files still in the fs tier after up to `timeout_s` (its rescans remove stale ones)."""
    deadline = time.monotonic() + timeout_s
    while (temps := fs.temps()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return temps


def _fsck_json(report: Any) -> dict[str, Any]:
    data = asdict(report) if hasattr(report, "__dataclass_fields__") else dict(vars(report))
    return {k: (len(v) if isinstance(v, list | dict) else v) for k, v in data.items()}


def outcome_during(o: Outcome, windows: list[dict[str, Any]], margin_s: float = 1.0) -> bool:
    """Whether request `o` (until its first token) overlaps a process fault's window."""
    first = o.start + (o.ttft or 0.0)
    return any(w["start"] - margin_s <= first and o.start <= w["end"] + margin_s for w in windows)

