"""vLLM engines with the KVTierConnector and an fs tier, of any tensor-parallel degree, for tests that
compare engines of different TP degrees sharing stored chunks, and engines one after the other on
one fs directory.

`LocalEngine(model, fs_dir, llm, tp)` builds an engine whose engine core, with the scheduler half
of the connector, runs in the test's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, from the
caller's `vllm_env`); a TP=1 engine's one worker does too, while a TP=2 engine spawns one worker
process per rank (each runs a worker half of the connector), one core per rank
(`VLLM_CPU_OMP_THREADS_BIND="0|1"`, set while it is built). Engines of one test run one after the
other, never two at once: a TP=2 engine's shutdown takes down this process's model-parallel
groups, which a TP=1 engine built before it still uses. A step is a text prompt served alone,
greedy, with each generated token's logprob; `scratch` steps neither load nor store through
kvtier. Before every step the device prefix cache is reset, so whatever is reused comes from
kvtier; after it the tier jobs are waited for, so its chunks are in `fs_dir` when the engine
exits. Every rank records the device pages of each chunk it stores (as the store is submitted)
and loads (once the load ended), by key and layer, and the state of each recurrent layer and part
(canonical orientation, channels first) it stores and loads, by the state's first row key and
`layer * parts + part`; `rank_pages(out_dir, tp)` reads them back (as bytes: uint8 arrays whose
last axis is the values' bytes): each `serve` writes what the engine recorded so far to its own
`out_dir`.

`mamba2_workaround`: vLLM 0.32's CPU Mamba2 layer crashes on the first prefill with prefix caching
on (`test_vllm_states`); THE TEST'S PROCESS WORKS AROUND IT while the engine is built, and
restores it then: the engine core sees the ranks' Mamba KV cache specs without the mid-prefill
checkpoint, so the KV cache config every rank gets has none and the scheduler cuts prefills at
block boundaries (the rank processes are spawned: vLLM's CPU platform forces it, so a patch of
their layers would not reach them). kvtier itself patches nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.integrations.vllm.serving.launch import transfer_config

BIND = "VLLM_CPU_OMP_THREADS_BIND"
SCRATCH = {"kvtier": {"skip_load": True, "skip_store": True}}
Pages = dict[tuple[str, str, int], np.ndarray]
"""(op, key hex, index) -> bytes on one rank: op "store" or "load", a chunk's device page of
attention layer `index`; op "store-state" or "load-state", part `index % parts` of recurrent layer
`index // parts`'s state."""


@dataclass(frozen=True)
class Step:
    prompt: str
    scratch: bool = False
    max_tokens: int = 6


@dataclass(frozen=True)
class Served:
    """One step's result: the prompt's token ids, its full chunks' keys (hex) and the chunk size,
    the generated tokens with their logprobs and, per position, the two likeliest tokens and their
    logprobs (`top2`), vLLM's cached-token count and kvtier's token split."""

    prompt: list[int]
    keys: list[str]
    chunk_tokens: int
    tokens: list[int]
    logprobs: list[float]
    cached: int
    split: dict[str, int]
    state_rows: int = 0
    top2: list[dict[str, float]] | None = None


def rank_pages(out_dir: Path, tp: int) -> list[Pages]:
    """Each rank's recorded pages (rank order) from the engine that wrote `out_dir`."""
    ranks = []
    for rank in range(tp):
        with np.load(out_dir / f"pages-rank{rank}.npz") as stored:
            pages = {}
            for name in stored.files:
                op, key, layer = name.split(".")
                pages[(op, key, int(layer))] = stored[name]
            ranks.append(pages)
    return ranks


_RECORDED: dict[str, np.ndarray] = {}
"""In a rank process: the pages recorded so far, by "op.key.layer"."""


def _record(half: Any, op: str, jobs: Any) -> None:
    from kvtier.format.layout import SKIP_BLOCK

    plan, tensors = half.transfer.plan, half.transfer.layer_tensors
    bpc = plan.blocks_per_chunk
    for job in jobs:
        for key, ids in zip(job.keys, job.block_ids, strict=True):
            for layer, kv in enumerate(tensors):
                group = plan.layer_groups[layer]
                blocks = list(ids[group * bpc : (group + 1) * bpc])
                if SKIP_BLOCK not in blocks:
                    _RECORDED[f"{op}.{key.hex()}.{layer}"] = _bytes(kv[blocks])


def _record_states(half: Any, op: str, jobs: Any) -> None:
    copier = half.transfer.states
    for job in jobs:
        for layer, (parts, block) in enumerate(zip(copier.tensors, job.block_ids, strict=True)):
            for p, (part, tensor) in enumerate(zip(copier.layout.parts, parts, strict=True)):
                state = tensor[block].transpose(0, 1) if part.transposed else tensor[block]
                _RECORDED[f"{op}-state.{job.keys[0].hex()}.{layer * len(parts) + p}"] = _bytes(state)


def _bytes(tensor: Any) -> np.ndarray:
    import torch

    return tensor.contiguous().view(torch.uint8).numpy().copy()


def install_spy(_vllm_worker: Any) -> None:
    """Run in every rank (`collective_rpc`): record the pages its connector half stores and loads.
    A rank in a process of its own also freezes its heap out of its collections
    (`tests.gc_freeze`), engine included: its shutdown and exit then take a fraction of a second,
    not seconds of collecting a heap the process is about to drop."""
    import multiprocessing

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tests.gc_freeze import freeze_imports

    if multiprocessing.parent_process() is not None:
        freeze_imports()

    half = get_kv_transfer_group().copier
    save, start_load = half.save, half.start_load
    _RECORDED.clear()  # an engine in the test's own process follows others there

    def spy_save(meta: Any) -> None:
        _record(half, "store", meta.stores)
        if meta.state_stores:
            _record_states(half, "store", meta.state_stores)
        save(meta)

    def spy_load(meta: Any) -> None:
        start_load(meta)
        _record(half, "load", meta.loads)
        if meta.state_loads:
            _record_states(half, "load", meta.state_loads)

    half.save, half.start_load = spy_save, spy_load


def dump_spy(_vllm_worker: Any, out_dir: str) -> None:
    from vllm.distributed import get_tensor_model_parallel_rank

    np.savez(Path(out_dir) / f"pages-rank{get_tensor_model_parallel_rank()}.npz", **_RECORDED)


def _serve(llm: Any, scheduler: Any, step: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from tests.integrations.shared_helpers import settle

    extra = {"kv_transfer_params": SCRATCH} if step["scratch"] else None
    params = SamplingParams(temperature=0.0, max_tokens=step["max_tokens"], logprobs=2, extra_args=extra)
    llm.reset_prefix_cache()
    done = llm.generate([step["prompt"]], params, use_tqdm=False)[0]
    settle(scheduler)
    out = done.outputs[0]
    prompt = list(done.prompt_token_ids)
    return {
        "prompt": prompt,
        "keys": [key.hex() for key in scheduler.hasher.keys(prompt)],
        "chunk_tokens": scheduler.geometry.chunk_tokens,
        "tokens": list(out.token_ids),
        "logprobs": [entry[tok].logprob for tok, entry in zip(out.token_ids, out.logprobs, strict=True)],
        "top2": [{str(tok): e.logprob for tok, e in entry.items() if e.rank is not None and e.rank <= 2}
                 for entry in out.logprobs],
        "cached": done.num_cached_tokens,
        "split": (done.kv_transfer_params or {}).get("kvtier", {}).get("tokens", {}),
        "state_rows": scheduler.geometry.states.layout.rows if scheduler.geometry.states else 0,
    }


def _declare_no_mamba2_checkpoint() -> Callable[[], None]:
    """Make the engine core see every Mamba state group without a mid-prefill checkpoint; returns
    what undoes it (the engine's KV cache config is fixed once it is built)."""
    import dataclasses

    from vllm.v1.executor.abstract import Executor
    from vllm.v1.kv_cache_interface import MambaSpec

    specs_of = Executor.get_kv_cache_specs
    none = {"num_prefill_checkpoint_blocks": 0, "prefill_checkpoint_alignment": None}

    def without_checkpoint(executor: Any) -> list[dict[str, Any]]:
        return [
            {name: dataclasses.replace(spec, **none) if isinstance(spec, MambaSpec) else spec
             for name, spec in specs.items()}
            for specs in specs_of(executor)
        ]

    def restore() -> None:
        Executor.get_kv_cache_specs = specs_of  # type: ignore[method-assign]

    Executor.get_kv_cache_specs = without_checkpoint  # type: ignore[method-assign]
    return restore


def _build(model: str, tp: int, fs_dir: str, llm_options: dict[str, Any], mamba2_workaround: bool,
           ) -> tuple[Any, Any]:
    """(LLM, its connector's scheduler half) with the spy installed in every rank."""
    from vllm import LLM

    # By this module's importable name, not __main__'s: the ranks unpickle the spy by reference.
    from tests.integrations import tp_engine

    # A tier process starved of CPU on a loaded 2-core machine (both cores pinned by the ranks)
    # has gone a minute without answering, and a tier declared hung answers MISS: wait longer.
    config = {"cpu_bytes_to_use": 4 << 20, "tier_job_timeout_s": 240.0,
              "secondary_tiers": [{"type": "fs", "root_dir": fs_dir}]}
    # The test-only workaround of vLLM's CPU Mamba2 crash (module doc).
    restore = _declare_no_mamba2_checkpoint() if mamba2_workaround else (lambda: None)
    try:
        llm = LLM(model=model, tensor_parallel_size=tp, kv_transfer_config=transfer_config(config),
                  **llm_options)
    finally:
        restore()
    llm.collective_rpc(tp_engine.install_spy)
    return llm, llm.llm_engine.engine_core.engine_core.scheduler.connector.planner


class LocalEngine:
    """An engine of TP degree `tp` whose engine core runs in the test's own process (vLLM's
    environment: `vllm_env`), no process to start but a TP=2 engine's rank processes, kept for
    several `serve` phases; a context manager."""

    def __init__(self, model: Path, fs_dir: Path, llm: dict[str, Any], tp: int = 1,
                 mamba2_workaround: bool = False) -> None:
        from vllm import envs

        saved = os.environ.get(BIND)
        if tp > 1:  # the rank processes, spawned while the engine is built, take one core each
            os.environ[BIND] = "|".join(str(rank) for rank in range(tp))
        # vLLM caches its environment once an engine is up: read it afresh for this engine, and
        # again for the next one, which must not see this engine's binding.
        envs.disable_envs_cache()
        try:
            self.llm, self.scheduler = _build(str(model), tp, str(fs_dir), llm, mamba2_workaround)
        finally:
            if saved is None:
                os.environ.pop(BIND, None)
            else:
                os.environ[BIND] = saved
            envs.disable_envs_cache()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.llm.llm_engine.engine_core.shutdown()

    def serve(self, steps: list[Step], out_dir: Path) -> list[Served]:
        from tests.integrations import tp_engine

        out_dir.mkdir(parents=True, exist_ok=True)
        served = [_serve(self.llm, self.scheduler, vars(step)) for step in steps]
        self.llm.collective_rpc(tp_engine.dump_spy, args=(str(out_dir),))
        return [Served(**one) for one in served]
