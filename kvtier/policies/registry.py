"""Policy names → classes, with `module_path` for external policies."""

from __future__ import annotations

from typing import Any

from kvtier.plugins import resolve_plugin
from kvtier.policies.base import AdmissionPolicy, EvictionPolicy

BUILTIN_EVICTION: dict[str, str] = {
    "lru": "kvtier.policies.lru:LRUPolicy",
    "arc": "kvtier.policies.arc:ARCPolicy",
}
BUILTIN_ADMISSION: dict[str, str] = {
    "all": "kvtier.policies.base:AdmitAll",
    "frequency": "kvtier.policies.admission:FrequencyAdmission",
    "priority": "kvtier.policies.admission:PriorityAdmission",
    "tenant_shares": "kvtier.policies.tier_shares:TierShares",
}


def resolve_eviction(name: str, module_path: str | None = None) -> type[EvictionPolicy[Any]]:
    """The eviction policy class for a config name (or a class name in `module_path`)."""
    return resolve_plugin("eviction_policy", name, module_path, BUILTIN_EVICTION, EvictionPolicy)


def resolve_admission(
    key: str, name: str, module_path: str | None = None
) -> type[AdmissionPolicy]:
    """The admission policy class for a config name: a built-in, else a class name in
    `module_path` (when given). `key` names the entry in errors (`admission_policy[1]`)."""
    builtin = name in BUILTIN_ADMISSION
    return resolve_plugin(
        key, name, None if builtin else module_path, BUILTIN_ADMISSION, AdmissionPolicy
    )
