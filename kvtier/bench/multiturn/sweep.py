"""The sweep: for each configuration, one engine; on it, one point per number of conversations.

`mode` "server" starts a vLLM OpenAI server per configuration (`server.VLLMServer`) and drives it
over HTTP with streaming; "inprocess" builds an in-process engine per configuration
(`engine_run.InProcessEngine`); "endpoint" drives an already running server (`Plan.endpoint`)
under the label `Plan.configs[0]` and starts nothing. Every engine gets one unmeasured warm-up
request first. Point n uses the tag "n<conversations>" for its text, so all configurations see
the same conversations at a given point, and one point's prefixes never help the next.

With a server the hit-quality split comes from `/metrics` counter deltas around the point (kvtier's
counters with the connector, vLLM's prefix-cache counters without), polled until they account for
every prompt token the client saw; in process each request carries its own split.

Results are written after every point (`report.save`), so an interrupted sweep keeps what it did.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.bench.multiturn import configs as config_registry
from kvtier.bench.multiturn import scrape
from kvtier.bench.multiturn.conversation import Tokenizer, WorkloadSpec
from kvtier.bench.multiturn.endpoint_run import run_endpoint_point
from kvtier.bench.multiturn.server import ServerSettings, VLLMServer, http_get
from kvtier.bench.multiturn.stats import RequestRecord, point_summary, sum_splits

METRICS_WAIT_S = 20.0


@dataclass
class Plan:
    """Everything a sweep needs (the CLI builds it from a preset and flags)."""

    spec: WorkloadSpec
    sweep: tuple[int, ...]
    configs: list[str]
    mode: str
    model: Path | None
    served_name: str
    tokenizer: Tokenizer
    block_size: int
    block_bytes: int
    max_model_len: int
    context: config_registry.BenchContext
    dtype: str = "float32"
    endpoint: str | None = None
    api_key: str | None = None
    vllm_args: tuple[str, ...] = ()
    log_dir: Path = field(default_factory=lambda: Path("."))


class Hooks:
    """Progress callbacks (the CLI shows them with rich); all optional."""

    def engine_starting(self, config: str) -> None: ...

    def point_starting(self, config: str, conversations: int, requests: int) -> None: ...

    def request_done(self, record: RequestRecord) -> None: ...

    def point_done(self, point: dict[str, Any]) -> None: ...


def _settings(plan: Plan, config: config_registry.EngineConfig) -> ServerSettings:
    if plan.model is None:
        raise ValueError("--model: needed to start an engine")
    return ServerSettings(plan.model, plan.served_name, plan.block_size, config.device_blocks,
                          plan.max_model_len, plan.spec.max_concurrency, plan.block_bytes,
                          plan.dtype, config.kvtier, plan.vllm_args)


def _wait_metrics(url: str, before: dict[scrape.Sample, float], splitter: scrape.Splitter,
                  expected: int) -> tuple[dict[scrape.Sample, float], dict[str, int]]:
    """Scrape until the split accounts for `expected` prompt tokens (stats reach the API server
    with the engine's next steps), or `METRICS_WAIT_S` passed."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        after = scrape.parse(http_get(url))
        split = splitter(before, after)
        if sum(split.values()) >= expected or time.monotonic() > deadline:
            return after, split
        time.sleep(0.25)


def _served_points(plan: Plan, name: str, base_url: str, hooks: Hooks,
                   emit: Callable[[dict[str, Any]], None], with_kvtier: bool) -> None:
    warm = replace(plan.spec, initial_tokens=160, tokens_per_turn=64, turns=1, conversations=1,
                   max_concurrency=1, output_tokens=2, seed=-1)
    run_endpoint_point(base_url, plan.served_name, warm, plan.tokenizer, "warm-up", api_key=plan.api_key)
    splitter: scrape.Splitter = scrape.kvtier_split if with_kvtier else scrape.vllm_split
    for n in plan.sweep:
        spec = replace(plan.spec, conversations=n)
        hooks.point_starting(name, n, n * spec.turns)
        before = scrape.parse(http_get(f"{base_url}/metrics"))
        records, client = run_endpoint_point(base_url, plan.served_name, spec, plan.tokenizer, f"n{n}",
                                             hooks.request_done, api_key=plan.api_key)
        expected = sum(r.prompt_tokens for r in records if not r.error)
        after, split = _wait_metrics(f"{base_url}/metrics", before, splitter, expected)
        source = "kvtier_metrics" if with_kvtier else "vllm_metrics"
        emit(point_summary(name, n, records, split, {
            "tokens_from": source, "preemptions": scrape.preemptions(before, after),
            "kvtier_transfers": scrape.transfers(before, after), "client": client}))


def _inprocess_points(plan: Plan, name: str, engine: Any, hooks: Hooks,
                      emit: Callable[[dict[str, Any]], None]) -> None:
    engine.warm_up()
    for n in plan.sweep:
        spec = replace(plan.spec, conversations=n)
        hooks.point_starting(name, n, n * spec.turns)
        records, client = engine.run_point(spec, f"n{n}", hooks.request_done)
        split = sum_splits([r.tokens for r in records if r.tokens and not r.error])
        emit(point_summary(name, n, records, split, {"tokens_from": "requests", "client": client}))


def run_sweep(plan: Plan, hooks: Hooks, emit: Callable[[dict[str, Any]], None]) -> None:
    """Run every configuration over every point; `emit` gets each point as it is done."""
    if plan.mode != "endpoint":
        config_registry.check_names(plan.configs)
    for name in plan.configs:
        hooks.engine_starting(name)
        if plan.mode == "endpoint":
            if plan.endpoint is None:
                raise ValueError("--endpoint: needed in endpoint mode")
            metrics = http_get(f"{plan.endpoint.rstrip('/')}/metrics")
            _served_points(plan, name, plan.endpoint.rstrip("/"), hooks, emit, "kvtier_" in metrics)
            continue
        config = config_registry.resolve(name, plan.context)
        settings = _settings(plan, config)
        if plan.mode == "server":
            log = plan.log_dir / f"server-{name.replace('+', '-')}.log"
            with VLLMServer(settings, log) as server:
                _served_points(plan, name, server.base_url, hooks, emit, config.kvtier is not None)
        elif plan.mode == "inprocess":
            from kvtier.bench.multiturn.engine_run import InProcessEngine

            with InProcessEngine(settings) as engine:
                _inprocess_points(plan, name, engine, hooks, emit)
        else:
            raise ValueError(f"--mode {plan.mode}: must be server, inprocess or endpoint")
