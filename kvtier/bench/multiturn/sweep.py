"""The sweep: configurations interleaved point by point, each point repeated; one engine per run.

The schedule (`schedule`): for each number of conversations, `repeats` rounds; each round runs every
configuration once, round r in the configurations' order rotated by r places; so every
configuration has run at a point before the next point starts, and none always runs first. Each
run is one fresh engine (so no run inherits another's caches) with a fresh work directory for its
tier files (removed afterwards), one unmeasured warm-up request, then the point. Point n, repeat r
uses the tag "n<n>" (r = 0) or "n<n>r<r>" for its text: every configuration sees the same
conversations in a round, and no run's prefixes help another.

`mode` "server" starts a vLLM OpenAI server per run (`vllm_server.VLLMServer`, its output appended
to `Plan.log_dir`/vllm.log) and drives it over HTTP with streaming; "inprocess" builds an
in-process engine per run (`engine_run.InProcessEngine`); "endpoint" drives already running servers
(`Plan.endpoints`: one, or a fleet routed by `Plan.route`, see `fleet`) under the label
`Plan.configs[0]` and starts nothing.

The hit-quality split: with kvtier, its counters (per request in process, `/metrics` deltas for a
server); otherwise vLLM's own counters (`native_split`: device prefix cache, and with a baseline
connector its reloads: vLLM's OffloadingConnector's by CPU and disk tier, LMCache's as one
number), from `/metrics` polled until they account for every prompt token the client saw, or in
process from the engine's registry; vLLM alone in process: each request's cached tokens.

With a `Mix` (server and endpoint modes) single-use requests are mixed in (`workload`); with a
`Ramp` a run is several points, one per concurrency step, each with `ramp` {step, concurrency}
and its own `/metrics` split.

Every point carries its `repeat`, its `run` (position in the schedule) and the machine's load
average when it ended (`loadavg`: a noisy neighbour shows). Results are written after every point
(`report.save`), so an interrupted sweep keeps what it did.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.bench.engine_log import LOG_NAME
from kvtier.bench.multiturn import configs as config_registry
from kvtier.bench.multiturn import scrape
from kvtier.bench.multiturn.conversation import Tokenizer, WorkloadSpec
from kvtier.bench.multiturn.endpoint_run import run_endpoint_point
from kvtier.bench.multiturn.fleet import instance_entries, merge_transfers
from kvtier.bench.multiturn.summary import RequestRecord, point_summary, sum_splits
from kvtier.bench.multiturn.vllm_server import ServerSettings, VLLMServer, http_get
from kvtier.bench.multiturn.workload import Mix, Ramp
from kvtier.format.chunks import DEVICE, HOST, RECOMPUTED

METRICS_WAIT_S = 20.0
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"

Emit = Callable[[dict[str, Any]], None]


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
    endpoints: tuple[str, ...] = ()
    api_key: str | None = None
    vllm_args: tuple[str, ...] = ()
    log_dir: Path = field(default_factory=lambda: Path("."))
    repeats: int = 1
    mix: Mix | None = None
    ramp: Ramp | None = None
    route: str = "round-robin"


@dataclass(frozen=True)
class Run:
    """One entry of the schedule: `config` at `conversations`, repeat `repeat` (from 0), the
    `index`-th run of the sweep."""

    index: int
    conversations: int
    repeat: int
    config: str

    @property
    def tag(self) -> str:
        """The text tag of this run's conversations (the same for every configuration)."""
        return f"n{self.conversations}" + (f"r{self.repeat}" if self.repeat else "")


class Hooks:
    """Progress callbacks (the CLI shows them with rich); all optional."""

    def engine_starting(self, config: str) -> None: ...

    def point_starting(self, config: str, conversations: int, requests: int) -> None: ...

    def request_done(self, record: RequestRecord) -> None: ...

    def point_done(self, point: dict[str, Any]) -> None: ...


def schedule(sweep: tuple[int, ...], configs: list[str], repeats: int) -> list[Run]:
    """Every run of the sweep in order (see the module docstring); ValueError for repeats < 1."""
    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: must be >= 1")
    order = [(n, r, configs[(i + r) % len(configs)])
             for n in sweep for r in range(repeats) for i in range(len(configs))]
    return [Run(index, n, r, name) for index, (n, r, name) in enumerate(order)]


def _counter_change(before: Mapping[scrape.Sample, float], after: Mapping[scrape.Sample, float],
                    name: str) -> dict[str, int]:
    old = scrape.by_label(before, name, "source")
    return {k: round(v - old.get(k, 0.0)) for k, v in scrape.by_label(after, name, "source").items()}


def native_split(before: Mapping[scrape.Sample, float],
                 after: Mapping[scrape.Sample, float]) -> dict[str, int]:
    """Prompt-token sources from vLLM's own counters between two scrapes: `scrape.vllm_split`, with
    the tokens a connector reloaded (`external_kv_transfer`) taken out of recomputed and split by
    the tier that supplied them (`CACHED_BY_SOURCE`, counted by vLLM's OffloadingConnector): its
    disk tier as `fs`, the rest as `host` (LMCache counts no tiers: all its reloads are `host`).
    Without reloads it is `scrape.vllm_split`."""
    split = scrape.vllm_split(before, after)
    reloaded = _counter_change(before, after, scrape.VLLM_TOKENS).get("external_kv_transfer", 0)
    if reloaded <= 0:
        return split
    fs = min(max(_counter_change(before, after, CACHED_BY_SOURCE).get("disk", 0), 0), reloaded)
    out = {DEVICE: split[DEVICE], HOST: reloaded - fs}
    if fs:
        out["fs"] = fs
    out[RECOMPUTED] = split[RECOMPUTED] - reloaded
    return out


def _settings(plan: Plan, config: config_registry.EngineConfig) -> ServerSettings:
    if plan.model is None:
        raise ValueError("--model: needed to start an engine")
    return ServerSettings(plan.model, plan.served_name, plan.block_size, config.device_blocks,
                          plan.max_model_len, plan.spec.max_concurrency, plan.block_bytes,
                          plan.dtype, config.kvtier, plan.vllm_args, config.connector)


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


def _served_point(plan: Plan, run: Run, base_urls: list[str], hooks: Hooks, emit: Emit,
                  with_kvtier: bool) -> None:
    """Serve the point; with a ramp, one point per step (its own `/metrics` split, scraped after
    the step drained). Several URLs are a fleet (`fleet`): the split is the sum of the instances'
    deltas, each instance's own is in the point's `instances`."""
    warm = replace(plan.spec, initial_tokens=160, tokens_per_turn=64, turns=1, conversations=1,
                   max_concurrency=1, output_tokens=2, seed=-1)
    for url in base_urls:
        run_endpoint_point(url, plan.served_name, warm, plan.tokenizer, "warm-up", api_key=plan.api_key)
    splitter: scrape.Splitter = scrape.kvtier_split if with_kvtier else native_split
    spec = replace(plan.spec, conversations=run.conversations)
    turns = run.conversations * spec.turns
    requests = (len(plan.ramp.levels) * plan.ramp.step_requests if plan.ramp and plan.ramp.step_requests
                else turns + (plan.mix.due(turns) if plan.mix else 0))
    hooks.point_starting(_label(plan, run), run.conversations, requests)
    urls = [f"{base}/metrics" for base in base_urls]
    scrapes = [[scrape.parse(http_get(url)) for url in urls]]  # per step boundary, per instance
    splits: list[list[dict[str, int]]] = []

    def step_done(step: int, records: list[RequestRecord]) -> None:
        afters, step_splits = [], []
        for index, url in enumerate(urls):
            expected = sum(r.prompt_tokens for r in records if not r.error and r.instance == index)
            after, split = _wait_metrics(url, scrapes[-1][index], splitter, expected)
            afters.append(after)
            step_splits.append(split)
        scrapes.append(afters)
        splits.append(step_splits)

    records, client = run_endpoint_point(base_urls, plan.served_name, spec, plan.tokenizer, run.tag,
                                         hooks.request_done, api_key=plan.api_key, mix=plan.mix,
                                         ramp=plan.ramp, on_step=step_done, route=plan.route)
    for step, step_splits in enumerate(splits):
        pairs = list(zip(scrapes[step], scrapes[step + 1], strict=True))
        mine = [r for r in records if r.step == step]
        extra: dict[str, Any] = {
            "tokens_from": "kvtier_metrics" if with_kvtier else "vllm_metrics",
            "preemptions": sum(scrape.preemptions(before, after) for before, after in pairs),
            "kvtier_transfers": merge_transfers([scrape.transfers(b, a) for b, a in pairs]),
            "client": client, **_where(run)}
        if len(base_urls) > 1:
            extra.update(route=plan.route, instances=instance_entries(base_urls, step_splits, mine))
        if plan.ramp is not None:
            extra["ramp"] = {"step": step, "concurrency": plan.ramp.levels[step]}
        emit(point_summary(run.config, run.conversations, mine, sum_splits(step_splits), extra))


def _inprocess_point(plan: Plan, run: Run, engine: Any, hooks: Hooks, emit: Emit) -> None:
    engine.warm_up()
    spec = replace(plan.spec, conversations=run.conversations)
    hooks.point_starting(_label(plan, run), run.conversations, run.conversations * spec.turns)
    baseline = engine.settings.connector is not None
    before = scrape.parse(engine.metrics_text()) if baseline else {}
    records, client = engine.run_point(spec, run.tag, hooks.request_done)
    if baseline:
        split, source = native_split(before, scrape.parse(engine.metrics_text())), "vllm_metrics"
    else:
        split, source = sum_splits([r.tokens for r in records if r.tokens and not r.error]), "requests"
    emit(point_summary(run.config, run.conversations, records, split, {
        "tokens_from": source, "client": client, **_where(run)}))


def _where(run: Run) -> dict[str, Any]:
    return {"repeat": run.repeat, "run": run.index, "loadavg": list(os.getloadavg())}


def _label(plan: Plan, run: Run) -> str:
    return run.config if plan.repeats == 1 else f"{run.config} #{run.repeat + 1}"


def _engine_run(plan: Plan, run: Run, hooks: Hooks, emit: Emit) -> None:
    """Start the run's engine in a fresh work directory, serve the point, stop, clean up."""
    work_dir = plan.context.work_dir / f"run{run.index}-{run.config.replace('+', '-')}"
    try:
        config = config_registry.resolve(run.config, replace(plan.context, work_dir=work_dir))
        settings = _settings(plan, config)
        if plan.mode == "server":
            with VLLMServer(settings, plan.log_dir / LOG_NAME) as server:
                _served_point(plan, run, [server.base_url], hooks, emit, config.kvtier is not None)
        elif plan.mode == "inprocess":
            from kvtier.bench.multiturn.engine_run import InProcessEngine

            with InProcessEngine(settings) as engine:
                _inprocess_point(plan, run, engine, hooks, emit)
        else:
            raise ValueError(f"--mode {plan.mode}: must be server, inprocess or endpoint")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def run_sweep(plan: Plan, hooks: Hooks, emit: Emit) -> None:
    """Run the schedule (`schedule`); `emit` gets each point as it is done."""
    if plan.mode != "endpoint":
        config_registry.check_names(plan.configs)
    if plan.mode == "inprocess" and (plan.mix is not None or plan.ramp is not None):
        raise ValueError("--mix, --ramp: not with --mode inprocess (use server mode or --endpoint)")
    for run in schedule(plan.sweep, plan.configs, plan.repeats):
        hooks.engine_starting(_label(plan, run))
        if plan.mode != "endpoint":
            _engine_run(plan, run, hooks, emit)
            continue
        if not plan.endpoints:
            raise ValueError("--endpoint or --endpoints: needed in endpoint mode")
        base_urls = [url.rstrip("/") for url in plan.endpoints]
        with_kvtier = ["kvtier_" in http_get(f"{url}/metrics") for url in base_urls]
        if len(set(with_kvtier)) > 1:
            raise ValueError("--endpoints: some instances run kvtier and some do not")
        _served_point(plan, run, base_urls, hooks, emit, with_kvtier[0])
