"""kvtier settings: the `kv_connector_extra_config` JSON dict parsed into typed, checked values.

Every error is a `ConfigError` naming the key (a dotted path such as `secondary_tiers[1].root_dir`),
the value and what is allowed; an unknown key is reported with the closest known key, never with its
value (a misspelt secret stays secret). Parsing has no side effect: nothing is created or started
here.

Secrets: a tier option that declares a `show` (`common.options`: the S3 secret key, a redis URL's
password, the p2p secret and CURVE key) is a secret. `redact` gives a config with each shown as its
option's `show` makes it, for printing; `split_secrets` takes them out of a config, and
`secrets_env` names an environment variable that gives them back at parse time, as a JSON object
`{tier name: {option: value}}`: `kvtier serve` hands vLLM its config that way, so no secret is on
the child's command line (`/proc/PID/cmdline` is readable by every local user).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvtier.errors import ConfigError, unknown_name_message
from kvtier.format.chunks import HOST
from kvtier.ops.guard import SLOGuardConfig
from kvtier.policies.base import AdmissionPolicy, AdmissionSettings, AdmitAll, EvictionPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.registry import resolve_admission, resolve_eviction
from kvtier.policies.tenants import TenantShares, parse_tenants
from kvtier.policies.tier_shares import TierShares
from kvtier.tiers.common import fleetkey
from kvtier.tiers.common.options import HIDDEN, Option
from kvtier.tiers.registry import check_tier_options, declared_options, resolve_tier

HASH_ALGORITHMS = ("sha256", "blake3")
ALWAYS, AUTO = "always", "auto"
LOAD_POLICIES = (ALWAYS, AUTO)
"""`load_policy`'s values (`kvtier.engine.load_choice`)."""
SECONDARY_MIN_PRIORITY = 35
"""A secondary tier's default `min_retention_priority` (TensorRT-LLM's default cut-off)."""
TIER_KEYS = ("type", "module_path", "name", "min_retention_priority")
"""The keys of a `secondary_tiers` entry that kvtier reads; the others are the tier's options."""
MAX_PRIORITY = 100


@dataclass(frozen=True)
class TierConfig:
    """One secondary tier: its type, optional plugin module, unique name and own options."""

    type: str
    name: str
    module_path: str | None = None
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    """The tier's own options, secrets included (so never in the repr)."""
    min_retention_priority: int = SECONDARY_MIN_PRIORITY
    """The lowest request retention priority the `priority` admission policy admits here."""


@dataclass(frozen=True)
class KVTierConfig:
    """Validated kvtier settings. Field names are the JSON keys."""

    cpu_bytes_to_use: int
    blocks_per_chunk: int = 1
    chunk_tokens: int | None = None
    """The chunk size in tokens, a multiple of the engine's block size (checked at engine start):
    `blocks_per_chunk` is then chunk_tokens / the engine's block size. None: `blocks_per_chunk`."""
    eviction_policy: str = "lru"
    eviction_policy_module_path: str | None = None
    admission_policy: tuple[str, ...] = ("all",)
    admission_policy_module_path: str | None = None
    admission_min_seen: int = 2
    host_min_retention_priority: int = 0
    max_client_priority: int = MAX_PRIORITY
    """The highest retention priority a request may have (0-100): a client's `priority` option, or
    its vLLM priority mapped, above it is lowered to it, so API clients cannot rank their chunks
    above what the operator allows. The default, 100, caps nothing."""
    hash_algorithm: str = "sha256"
    fleet_key_file: str | None = None
    """A file holding the fleet key (`tiers.common.fleetkey`: private to its owner, at least 32
    bytes): every chunk a secondary tier stores is MACed with it, and one that fails the MAC is a
    counted miss. Checked here and read by each tier process; the key itself is never in a config,
    on a command line or in a message. None: unkeyed checksums."""
    secondary_tiers: tuple[TierConfig, ...] = ()
    secrets_env: str | None = None
    """An environment variable holding secret tier options, `{tier name: {option: value}}` in JSON,
    merged into `secondary_tiers` at parse time (see the module doc). None: none."""
    tier_job_timeout_s: float = 60.0
    tier_restart_backoff_s: float = 1.0
    tier_lookup_wait_s: float = 0.01
    promotion_wait_s: float = 0.0
    """How long a lookup that started a promotion (secondary → host, not streamed) waits for it
    on the scheduler thread, so its request loads in the same step (0: it is asked again on the
    next step)."""
    stream_promotions: bool = True
    """A prefix longer than the host tier has room for is promoted and copied to the device a batch
    at a time (False: the chunks that do not fit are recomputed)."""
    sync_host_loads: bool = True
    """On the CPU backend, a model with one KV cache group: a load served by the host tier alone is
    copied before the forward pass of the step that schedules its request (vLLM's synchronous
    load), instead of a step before it (False: every load is asynchronous)."""
    load_policy: str = ALWAYS
    """`always`: load every chunk a tier holds; `auto`: promote a run of chunks from the secondary
    tiers only as far as loading it is measured to come back sooner than recomputing it."""
    tenants: TenantShares | None = None
    """Each tenant's share of the host tier's bytes, by `cache_salt` (`kvtier.policies.tenants`):
    `{"<salt>": share, ..., "default": share}`, each share a cap from 0 to 1 (they may sum over
    1); `default`: the share of requests without a salt, and apart that of the salts not named
    (absent: half of what the named shares leave, at least 0, so that the caps sum to 1). A share
    may be an object by tier, `{"host": 0.5, "<tier name>": 0.25}`: shares of secondary tiers, kept
    at their admission gate by `tenant_shares` (`policies.tier_shares`, added to the admission
    policies). None: no shares, every tenant in one cache."""
    shm_dir: str = "/dev/shm"
    os_reserve_bytes: int | None = None
    """Host memory the memory plan keeps for the OS, its page cache and co-located services: the
    host tier is refused when MemTotal less the engine's needs and the host tier leaves less
    (`kvtier.host.budget`). None: a tenth of MemTotal."""
    trace_path: str | None = None
    """Each finished request appends a record here (`kvtier.trace.writer`); None: no trace."""
    trace_max_bytes: int = 256 << 20
    """The trace file is rotated to `trace_path.1` at this size."""
    slo_guard: SLOGuardConfig | None = None
    control_dir: str | None = None
    """Where the control socket for `kvtier ctl` is made (None: `control.default_control_dir()`)."""
    eviction_class: type[EvictionPolicy[Any]] = field(default=LRUPolicy, compare=False, repr=False)
    """The class `eviction_policy` names, resolved once when the config is parsed."""
    admission_classes: tuple[type[AdmissionPolicy], ...] = field(
        default=(AdmitAll,), compare=False, repr=False
    )
    """The classes `admission_policy` names, resolved once when the config is parsed."""

    def admission_settings(self) -> AdmissionSettings:
        """The settings every admission policy is built with (per-tier priority minimums)."""
        minimums = {HOST: self.host_min_retention_priority}
        minimums.update((t.name, t.min_retention_priority) for t in self.secondary_tiers)
        return AdmissionSettings(min_seen=self.admission_min_seen, min_retention_priority=minimums)

    @classmethod
    def field_names(cls) -> list[str]:
        """The JSON keys (every field but the resolved classes)."""
        return [f.name for f in fields(cls) if not f.name.endswith(("_class", "_classes"))]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> KVTierConfig:
        """Parse and validate a config dict; `secrets_env` is read from `environ` (default: this
        process's environment)."""
        if not isinstance(raw, Mapping):
            raise ConfigError("kv_connector_extra_config", HIDDEN, "must be a JSON object")
        known = cls.field_names()
        for key in raw:
            if key not in known:
                raise ConfigError(key, HIDDEN, unknown_name_message(str(key), known))
        if "cpu_bytes_to_use" not in raw:
            raise ConfigError("cpu_bytes_to_use", None, "required: the host region size in bytes")
        policy = _string(raw, "eviction_policy", "lru")
        policy_mp = _optional_string(raw, "eviction_policy_module_path")
        admission_mp = _optional_string(raw, "admission_policy_module_path")
        admission, admission_classes = _admission(raw.get("admission_policy", "all"), admission_mp)
        hash_algorithm = _string(raw, "hash_algorithm", "sha256")
        if hash_algorithm not in HASH_ALGORITHMS:
            raise ConfigError("hash_algorithm", hash_algorithm, f"one of {HASH_ALGORITHMS}")
        secrets_env = _optional_string(raw, "secrets_env")
        load_policy = raw.get("load_policy", ALWAYS)
        if load_policy not in LOAD_POLICIES:
            raise ConfigError("load_policy", load_policy, f"one of {', '.join(LOAD_POLICIES)}")
        secrets = _env_secrets(secrets_env, os.environ if environ is None else environ)
        if "chunk_tokens" in raw and "blocks_per_chunk" in raw:
            raise ConfigError("chunk_tokens", raw["chunk_tokens"],
                              "give chunk_tokens or blocks_per_chunk, not both")
        tiers = _tiers(raw.get("secondary_tiers", []), secrets)
        names = [t.name for t in tiers]
        tenants = None if raw.get("tenants") is None else parse_tenants(raw["tenants"], names)
        if tenants is not None and TierShares not in admission_classes:
            admission_classes = (*admission_classes, TierShares)
        return cls(
            cpu_bytes_to_use=_int(raw, "cpu_bytes_to_use", None, minimum=1),
            blocks_per_chunk=_int(raw, "blocks_per_chunk", 1, minimum=1),
            chunk_tokens=_int(raw, "chunk_tokens", None, minimum=1) if "chunk_tokens" in raw else None,
            eviction_policy=policy,
            eviction_policy_module_path=policy_mp,
            admission_policy=admission,
            admission_policy_module_path=admission_mp,
            admission_min_seen=_int(raw, "admission_min_seen", 2, minimum=1),
            host_min_retention_priority=_priority(raw, "host_min_retention_priority", 0),
            max_client_priority=_priority(raw, "max_client_priority", MAX_PRIORITY),
            hash_algorithm=hash_algorithm,
            fleet_key_file=_fleet_key_file(raw),
            secondary_tiers=tiers,
            secrets_env=secrets_env,
            tier_job_timeout_s=_float(raw, "tier_job_timeout_s", 60.0),
            tier_restart_backoff_s=_float(raw, "tier_restart_backoff_s", 1.0),
            tier_lookup_wait_s=_float(raw, "tier_lookup_wait_s", 0.01, minimum=0.0),
            promotion_wait_s=_float(raw, "promotion_wait_s", 0.0, minimum=0.0),
            stream_promotions=_bool(raw, "stream_promotions", True),
            sync_host_loads=_bool(raw, "sync_host_loads", True),
            load_policy=load_policy,
            tenants=tenants,
            shm_dir=_string(raw, "shm_dir", "/dev/shm"),
            os_reserve_bytes=(None if raw.get("os_reserve_bytes") is None
                              else _int(raw, "os_reserve_bytes", None, minimum=0)),
            trace_path=_optional_string(raw, "trace_path"),
            trace_max_bytes=_int(raw, "trace_max_bytes", 256 << 20, minimum=4096),
            control_dir=_optional_string(raw, "control_dir"),
            slo_guard=None if raw.get("slo_guard") is None else SLOGuardConfig.from_dict(raw["slo_guard"]),
            eviction_class=resolve_eviction(policy, policy_mp),
            admission_classes=admission_classes,
        )


def _admission(
    value: object, module_path: str | None
) -> tuple[tuple[str, ...], tuple[type[AdmissionPolicy], ...]]:
    """`admission_policy`: one name or a non-empty list of names (all must admit)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names:
        raise ConfigError("admission_policy", value, "must be a policy name or a non-empty list of them")
    if isinstance(value, str):
        keys = ["admission_policy"]
    else:
        keys = [f"admission_policy[{i}]" for i in range(len(names))]
    classes = tuple(resolve_admission(k, n, module_path) for k, n in zip(keys, names, strict=True))
    if len(set(names)) != len(names):
        raise ConfigError("admission_policy", value, "names a policy twice")
    return tuple(names), classes


def _priority(raw: Mapping[str, Any], key: str, default: int, prefix: str = "") -> int:
    """A retention priority: an integer from 0 to 100."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        raise ConfigError(prefix + key, value, "must be an integer from 0 to 100")
    return value


def _int(raw: Mapping[str, Any], key: str, default: int | None, *, minimum: int) -> int:
    value = raw.get(key, default)
    # JSON writers often emit sizes as floats (1e9): accept those that are whole numbers.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"must be an integer >= {minimum}")
    return value


def _float(raw: Mapping[str, Any], key: str, default: float, minimum: float | None = None) -> float:
    """A finite number above 0, or at least `minimum` when given."""
    value = raw.get(key, default)
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not (value >= minimum if minimum is not None else value > 0):
        allowed = f"a number >= {minimum}" if minimum is not None else "a positive number"
        raise ConfigError(key, value, f"must be {allowed}")
    if not math.isfinite(value):
        raise ConfigError(key, value, "must be finite")
    return float(value)


def _bool(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(key, value, "must be true or false")
    return value


def _string(raw: Mapping[str, Any], key: str, default: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, "must be a non-empty string")
    return value


def _optional_string(raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(key, value, "must be a non-empty string or absent")
    return value


def _fleet_key_file(raw: Mapping[str, Any]) -> str | None:
    """`fleet_key_file`, made absolute (tier processes may start elsewhere), once its file is
    checked (read, never kept)."""
    path = _optional_string(raw, fleetkey.OPTION)
    if path is None:
        return None
    path = os.path.abspath(path)
    fleetkey.FleetKey.from_file(path)
    return path


def _tiers(value: object, secrets: Mapping[str, Mapping[str, Any]]) -> tuple[TierConfig, ...]:
    """The `secondary_tiers` entries, each with its options from `secrets` (by tier name) added."""
    if not isinstance(value, list):
        raise ConfigError("secondary_tiers", HIDDEN, "must be a list of tier objects")
    tiers: list[TierConfig] = []
    names: set[str] = set()
    for i, entry in enumerate(value):
        key = f"secondary_tiers[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(key, HIDDEN, 'must be an object such as {"type": "fs", ...}')
        if "type" not in entry:
            raise ConfigError(f"{key}.type", None, "required: the tier type")
        name = entry.get("name", entry["type"])
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{key}.name", name, "letters, digits, '-' and '_' only")
        if name in names:
            raise ConfigError(f"{key}.name", name, "tier names must be unique; set a distinct name")
        names.add(name)
        options = {k: v for k, v in entry.items() if k not in TIER_KEYS}
        for option in secrets.get(name, {}):
            if option in options:
                raise ConfigError(f"{key}.{option}", HIDDEN, "given both here and in secrets_env; "
                                  "give it once")
        options.update(secrets.get(name, {}))
        cls = resolve_tier(key, entry["type"], entry.get("module_path"))
        check_tier_options(key, cls, options)
        minimum = _priority(entry, "min_retention_priority", SECONDARY_MIN_PRIORITY, f"{key}.")
        tiers.append(TierConfig(entry["type"], name, entry.get("module_path"), options, minimum))
    if unknown := sorted(secrets.keys() - names):
        raise ConfigError("secrets_env", HIDDEN, f"names tiers not in secondary_tiers: {unknown}")
    return tuple(tiers)


def _env_secrets(name: str | None, environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The secret tier options in the environment variable `name` (none when `name` is None)."""
    if name is None:
        return {}
    if name not in environ:
        raise ConfigError("secrets_env", name, "names an environment variable that is not set")
    try:
        secrets = json.loads(environ[name])
    except json.JSONDecodeError:
        secrets = None
    if not isinstance(secrets, dict) or not all(
            isinstance(v, dict) and all(isinstance(k, str) for k in v) for v in secrets.values()):
        raise ConfigError("secrets_env", name, "the variable must hold a JSON object "
                          "{tier name: {option: value}}")
    return secrets


def _secret_options(entry: Mapping[str, Any]) -> dict[str, Option]:
    """The secret options (those with a `show`) that the tier of `entry` declares, by name."""
    declared = declared_options(resolve_tier("secondary_tiers", entry["type"], entry.get("module_path")))
    return {o.name: o for o in declared or () if o.show is not None}


def redact(extra: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the config `extra` (one `from_dict` accepts) with each secret tier option shown as
    its option's `show` makes it: a config safe to print or log."""
    out = dict(extra)
    tiers = []
    for entry in extra.get("secondary_tiers", []):
        secret = _secret_options(entry)
        tiers.append({k: secret[k].show(v) if k in secret and v is not None else v  # type: ignore[misc]
                      for k, v in entry.items()})
    if tiers:
        out["secondary_tiers"] = tiers
    return out


def split_secrets(extra: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The config `extra` (one `from_dict` accepts) without its secret tier options, and those
    options by tier name: what `secrets_env` gives back."""
    out = dict(extra)
    secrets: dict[str, dict[str, Any]] = {}
    tiers = []
    for entry in extra.get("secondary_tiers", []):
        secret = _secret_options(entry)
        tiers.append({k: v for k, v in entry.items() if k not in secret})
        taken = {k: v for k, v in entry.items() if k in secret}
        if taken:
            secrets[entry.get("name", entry["type"])] = taken
    if tiers:
        out["secondary_tiers"] = tiers
    return out, secrets
