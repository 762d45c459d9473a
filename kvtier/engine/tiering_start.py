"""Start an engine's tiering from its config: the host region and tier, every secondary tier's
process, the admission chain, and the manager over them."""

from __future__ import annotations

from kvtier.config import KVTierConfig
from kvtier.host import generations
from kvtier.host.tier import HostTier
from kvtier.manager import TieringManager
from kvtier.ops.metrics import KVTierMetrics
from kvtier.policies.admission import AdmissionChain
from kvtier.policies.tier_shares import TierShares
from kvtier.tiers.process import TierProcess, TierSpec


def start_manager(config: KVTierConfig, row_bytes: int, layout_fingerprint: str) -> TieringManager:
    """Create the host region and tier, and start every secondary tier's process; all or nothing:
    when a part fails, what was built is shut down in reverse order, the error raised."""
    rows = generations.create_region(config.cpu_bytes_to_use, row_bytes, config.shm_dir)
    region, num_slots = rows.region, rows.num_slots
    metrics = KVTierMetrics()  # the manager's, which every tier process counts into too
    started: list[TierProcess] = []
    try:
        policy, gens = config.eviction_class(num_slots), rows.generations
        host = HostTier(region.buf[: num_slots * row_bytes], row_bytes, policy, gens, config.tenants)
        for i, tier in enumerate(config.secondary_tiers):
            spec = TierSpec(
                tier_name=tier.name, type=tier.type, module_path=tier.module_path,
                options=tier.options, config_key=f"secondary_tiers[{i}]",
                region_name=region.name, shm_dir=config.shm_dir, row_bytes=row_bytes,
                num_slots=num_slots, layout_fingerprint=layout_fingerprint,
                generations_offset=rows.offset, fleet_key_file=config.fleet_key_file)
            proc = TierProcess(spec, job_timeout_s=config.tier_job_timeout_s,
                               restart_backoff_s=config.tier_restart_backoff_s, metrics=metrics)
            proc.launch()
            started.append(proc)
        for proc in started:
            proc.wait_ready()
        chain = AdmissionChain([c(config.admission_settings()) for c in config.admission_classes])
        manager = TieringManager(host, started, chain, metrics, lookup_wait_s=config.tier_lookup_wait_s)
        for admission in chain.policies:  # `tenant_shares` follows the tenants in the tiers
            if isinstance(admission, TierShares) and config.tenants is not None:
                admission.bind(config.tenants, host.tenant_of, manager.tiers, row_bytes, metrics)
    except BaseException:
        for proc in reversed(started):
            proc.shutdown()
        region.close()
        raise
    manager.region = region
    return manager
