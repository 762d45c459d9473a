"""Per-request kvtier options, read from vLLM's `kv_transfer_params`.

A client sets them per request, e.g. `SamplingParams(extra_args={"kv_transfer_params":
{"kvtier": {"skip_store": true}}})` or the same object under `kv_transfer_params` in an
OpenAI-compatible request:

- `skip_load` (bool): do not load this request's prefix from kvtier (vLLM's own cache still serves).
- `skip_store` (bool): do not store this request's chunks.
- `load_tiers` (list of tier names): the secondary tiers allowed to serve its prefix (the host tier
  always may); absent: all of them.
- `priority` (int, 0-100): the retention priority of its chunks, for admission (each tier's
  `min_retention_priority`) and host-tier eviction (lower priorities leave first). Absent: vLLM's
  own request priority mapped onto 0-100 (`retention_priority`).

Parsed once per request on the scheduler thread, when the request is first seen. A malformed option
never fails the request: it is logged and the default is used.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.policies.base import DEFAULT_PRIORITY

log = logging.getLogger("kvtier.engine.request_options")

PARAMS_KEY = "kvtier"
OPTION_NAMES = frozenset({"skip_load", "skip_store", "load_tiers", "priority"})


@dataclass(frozen=True)
class RequestOptions:
    """What one request asks of kvtier; the defaults are what a request without options gets."""

    skip_load: bool = False
    skip_store: bool = False
    load_tiers: frozenset[str] | None = None
    priority: int | None = None

    @classmethod
    def from_params(cls, req_id: str, params: Mapping[str, Any] | None) -> RequestOptions:
        """The options under `params["kvtier"]`; defaults for anything absent or malformed."""
        raw = params.get(PARAMS_KEY) if isinstance(params, Mapping) else None
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            log.warning("request %s: kv_transfer_params.%s must be an object, ignored", req_id, PARAMS_KEY)
            return cls()
        for key in raw.keys() - OPTION_NAMES:
            log.warning("request %s: unknown kvtier option %r ignored (known: %s)", req_id, key, OPTION_NAMES)
        return cls(
            skip_load=_typed(req_id, raw, "skip_load", bool, False),
            skip_store=_typed(req_id, raw, "skip_store", bool, False),
            load_tiers=_tiers(req_id, raw.get("load_tiers")),
            priority=_priority(req_id, raw.get("priority")),
        )


def retention_priority(options: RequestOptions, vllm_priority: int) -> int:
    """The request's retention priority (0-100): its kvtier `priority` option, else vLLM's request
    priority mapped so that vLLM's default 0 gives 50 (`DEFAULT_PRIORITY`) and each step more
    urgent (vLLM serves lower values first) gives one more, clamped to 0-100."""
    if options.priority is not None:
        return options.priority
    return min(max(DEFAULT_PRIORITY - vllm_priority, 0), 100)


def _priority(req_id: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        log.warning(
            "request %s: kvtier option priority=%r is not an integer from 0 to 100, ignored",
            req_id, value,
        )
        return None
    return value


def _typed(req_id: str, raw: Mapping[str, Any], key: str, kind: type[Any], default: Any) -> Any:
    value = raw.get(key, default)
    # bool is an int subclass: a priority of True is a mistake, not 1.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        log.warning("request %s: kvtier option %s=%r is not a %s, ignored", req_id, key, value, kind.__name__)
        return default
    return value


def _tiers(req_id: str, value: object) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        log.warning("request %s: kvtier option load_tiers=%r is not a list of names, ignored", req_id, value)
        return None
    return frozenset(value)
