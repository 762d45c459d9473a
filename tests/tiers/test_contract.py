"""The secondary-tier contract, checked for every built-in tier, in-process and in a tier process
(the suite: `contract_suite.ContractSuite`).

The memory tier is the model: every tier must give the same observable answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.host.region import HostRegion
from kvtier.tiers.base import TierContext
from kvtier.tiers.process import TierProcess, TierSpec
from kvtier.tiers.registry import BUILTIN_TIERS, resolve_tier
from tests.conftest import LAYOUT_FP, ROW_BYTES, SLOTS
from tests.tiers.contract_suite import ContractSuite

SERVICE_TIERS = {"obj": "s3_tier_options", "redis": "redis_tier_options"}
"""Tiers backed by a server: the fixture (in tests/services/) giving options for a fresh namespace."""
VARIANTS = {"redis-cluster": ("redis", "cluster_tier_options")}
"""More setups of a built-in tier: its type, and the fixture giving its options. In this process
only: the tier process around them is the one the tier's own setup already runs in."""
PEER_TIERS = {"p2p"}
"""Tiers whose contract needs a second instance: covered by their own tests."""
CONTRACT_TIERS = [t for t in ("memory", "fs", *SERVICE_TIERS) if t in BUILTIN_TIERS]


def tier_options(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    if name == "fs":
        return {"root_dir": str(tmp_path / "fs")}
    fixture = SERVICE_TIERS.get(name) or VARIANTS.get(name, ("", ""))[1]
    return dict(request.getfixturevalue(fixture)) if fixture else {}


@pytest.fixture(params=[(k, mode) for k in CONTRACT_TIERS for mode in ("inproc", "process")]
                + [(k, "inproc") for k in VARIANTS], ids=lambda p: f"{p[0]}-{p[1]}")
def tier(request, ctx: TierContext, region: HostRegion, tmp_path: Path) -> Iterator[object]:
    name, mode = request.param
    kind = VARIANTS.get(name, (name, ""))[0]
    options = tier_options(name, request, tmp_path)
    if mode == "inproc":
        t = resolve_tier("t", kind, None)(ctx, **options)
        yield t
        t.shutdown()
        return
    spec = TierSpec(
        tier_name=kind, type=kind, module_path=None, options=options, config_key="secondary_tiers[0]",
        region_name=region.name, shm_dir="/dev/shm", row_bytes=ROW_BYTES, num_slots=SLOTS,
        layout_fingerprint=LAYOUT_FP,
    )
    proc = TierProcess(spec, job_timeout_s=20)
    proc.start()
    yield proc
    proc.shutdown()


def test_every_builtin_tier_is_covered() -> None:
    assert set(BUILTIN_TIERS) - PEER_TIERS == set(CONTRACT_TIERS)


class TestContract(ContractSuite):
    """The contract suite over every built-in tier but p2p, in this process and in a tier process,
    and over the redis tier on a cluster."""
