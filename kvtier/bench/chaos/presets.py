"""The campaign's named shapes: the workload, the caches, how hard the injectors push, and when
the run stops.

- `smoke` (CI, under 3 minutes here): 4 conversations of 3 turns, rounds until at least 3 rounds,
  60 corruptions and each process fault run once, a corruption every 0.5 s and every process fault
  in turn every 3 s.
- `full`: 8 conversations of 4 turns, rounds until each shared tier (obj, the cluster, p2p) has
  detected at least 300 corruptions (and at least 3 rounds, at most `max_s` seconds of rounds), two
  corruptions every 0.25 s while under half of a tier's chunks are corrupted, every process fault
  in turn every 8 s. Requests take turns at the secondary tier they may load from (`load_tiers`,
  `load_rotation`: the shared tiers at least twice as often as fs and redis): the engine loads a chunk from
  the first tier that holds it, so without the rotation the others would be read only for what fs
  lacks, and their corruptions would mostly go unread.
- `soak`: the `smoke` workload for `--duration` seconds (default 30 minutes) with host eviction
  and cascades and no injector, sampling the engine's process tree (the engine and its tier processes)
  every 10 s (every duration / 40 when shorter); the verdict is growth under 5 % after the warm-up
  (the first round, when every conversation was stored once, or a quarter of the duration up to
  2 minutes, whichever is later).

Tiers (`tiers`, named by these words): `fs`, `obj` (SeaweedFS), `redis` (one redis-server),
`cluster` (the redis tier on a three-master Valkey Cluster) and `p2p` (the engine's p2p tier,
loading from a peer process that holds what the fs tier holds).

Caches: chunks of one 32-token block; a device cache of `device_blocks`, a host tier of
`host_chunks` (both far below the workload, so both evict and every round reloads from the
secondary tiers), secondary tiers sized never to evict (so that only verification removes a
chunk), the fs tier on a tmpfs of `fs_mib` (the ENOSPC fault fills it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtier.bench.chaos.faults import FAULTS, Pace
from kvtier.bench.multiturn.conversation import WorkloadSpec

ALL_TIERS = ("fs", "obj", "redis", "cluster", "p2p")
SHARED = ("obj", "cluster", "p2p")
FULL_ROTATION = ("cluster", "obj", "p2p", "cluster", "obj", "cluster", "fs", "p2p", "cluster", "obj",
                 "cluster", "p2p", "redis", "cluster", "obj")
"""The shared tiers read three to six times as often as fs and redis, in proportion to the loads
each needs per detection (measured: p2p about 0.9 detections per request loading from it, obj 0.6,
the cluster 0.4: more of the cluster's corruptions are overwritten by a new store of their chunk
before a load reads them)."""


@dataclass(frozen=True)
class ChaosPreset:
    name: str
    spec: WorkloadSpec
    pace: Pace | None
    min_rounds: int
    min_corruptions: int = 0
    duration_s: float | None = None
    max_rounds: int = 50
    device_blocks: int = 32
    host_chunks: int = 16
    fs_mib: int = 1024
    hang_s: float = 120.0
    sample_every_s: float | None = None
    warm_up_s: float = 120.0
    tiers: tuple[str, ...] = ALL_TIERS
    load_rotation: tuple[str, ...] = ()
    """Request n may load from secondary tier `load_rotation[n % len]` only (empty: from any)."""
    detect_tiers: tuple[str, ...] = ()
    min_detected: int = 0
    """Rounds go on until each of `detect_tiers` detected at least this many corruptions."""
    max_s: float | None = None
    """No round starts after this many seconds (whatever the other rules say)."""


PRESETS: dict[str, ChaosPreset] = {
    "smoke": ChaosPreset(
        "smoke", WorkloadSpec(128, 48, 3, 4, 4, 4), Pace(0.5, 1, 3.0, 1.5, FAULTS), min_rounds=3,
        max_rounds=200, min_corruptions=60, device_blocks=20, host_chunks=8, fs_mib=256, hang_s=60.0),
    "full": ChaosPreset(
        "full", WorkloadSpec(160, 48, 4, 8, 4, 6), Pace(0.25, 3, 8.0, 2.0, FAULTS, max_open=0.5),
        min_rounds=3, max_rounds=200,
        load_rotation=FULL_ROTATION,
        detect_tiers=SHARED, min_detected=300, max_s=1500.0),
    "soak": ChaosPreset(
        "soak", WorkloadSpec(128, 48, 3, 4, 4, 4), None, min_rounds=1, duration_s=1800.0,
        max_rounds=10_000, device_blocks=20, host_chunks=8, sample_every_s=10.0,
        tiers=("fs", "obj", "redis")),
}


def preset(name: str, duration_s: float | None = None) -> ChaosPreset:
    """The preset `name` (ValueError lists the known ones), with `duration_s` when given."""
    if name not in PRESETS:
        raise ValueError(f"--preset {name}: unknown (known: {', '.join(PRESETS)})")
    found = PRESETS[name]
    if duration_s is not None:
        if duration_s <= 0:
            raise ValueError(f"--duration {duration_s}: must be > 0")
        every = None if found.sample_every_s is None else min(found.sample_every_s, duration_s / 40)
        found = replace(found, duration_s=duration_s, max_rounds=10_000,
                        warm_up_s=min(found.warm_up_s, duration_s / 4), sample_every_s=every)
    return found
