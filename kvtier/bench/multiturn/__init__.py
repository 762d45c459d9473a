"""`kvtier bench multiturn`: the multi-turn tiering benchmark, also usable from Python.

The pieces, one concept per module: `corpus` (deterministic report text), `conversation` (the
workload spec and one conversation, sized in real tokens or following a script), `chats` (the
fixed scripts `kvtier demo` serves), `presets`, `configs` (named engine configurations),
`client` + `endpoint_run` (an OpenAI-compatible endpoint, streaming; `fleet`: several, routed),
`engine_run` (an in-process engine), `server` (one vLLM server per configuration), `scrape` (hit
quality from `/metrics`), `stats` (per-point summary), `sweep`, `report` (JSON, CSV, table, PNG), `progress`,
`cli`. The Python API: `kvtier.bench.multiturn.sweep.run_sweep(Plan, Hooks, emit)`, or one point
with `endpoint_run.run_endpoint_point` / `engine_run.InProcessEngine.run_point`. Importing this
package needs only kvtier itself (the `bench` extra's httpx, rich and matplotlib are imported by the
modules that use them).
"""

from kvtier.bench.multiturn.conversation import Conversation, WorkloadSpec
from kvtier.bench.multiturn.presets import PRESETS, Preset

__all__ = ["PRESETS", "Conversation", "Preset", "WorkloadSpec"]
