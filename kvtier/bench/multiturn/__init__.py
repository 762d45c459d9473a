"""`kvtier bench multiturn`: the multi-turn tiering benchmark, also usable from Python.

The pieces, one concept per module: `corpus` (deterministic report text), `conversation` (the
workload spec and one conversation, sized in real tokens), `presets`, `configs` (named engine
configurations), `client` + `endpoint_run` (an OpenAI-compatible endpoint, streaming), `engine_run`
(an in-process engine), `server` (one vLLM server per configuration), `scrape` (hit quality from
`/metrics`), `stats` (per-point summary), `sweep`, `report` (JSON, CSV, table, PNG), `progress`,
`cli`.
"""

from kvtier.bench.multiturn.conversation import Conversation, WorkloadSpec
from kvtier.bench.multiturn.presets import PRESETS, Preset
from kvtier.bench.multiturn.sweep import Hooks, Plan, run_sweep

__all__ = ["PRESETS", "Conversation", "Hooks", "Plan", "Preset", "WorkloadSpec", "run_sweep"]
