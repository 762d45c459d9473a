"""When loading a prefix pays: the one rule both `load_policy: auto` (the engine, per request, from
the speeds it measures) and `kvtier plan`'s verdict (from a trace, before an engine runs) apply, so
that the plan never recommends an offload the engine would then decline, nor the reverse.

A load pays when it comes back sooner than recomputing the same tokens by a margin (`MARGIN`): an
estimate within a tenth of the recompute time is too close to call, and recomputing then costs
nothing a tier could fail.
"""

from __future__ import annotations

MARGIN = 0.9
"""A load pays only when its expected time is under this share of the recompute time."""


def load_pays(load_s: float, recompute_s: float) -> bool:
    """Whether a load expected to take `load_s` seconds pays against recomputing its tokens in
    `recompute_s` seconds."""
    return load_s < MARGIN * recompute_s
