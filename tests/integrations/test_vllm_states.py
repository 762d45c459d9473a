"""Real vLLM (CPU backend, in-process, prefix caching on: `mamba_cache_mode` "align") on tiny
random-weight recurrent hybrids (`kvtier.tools.tiny_models`), 64-token blocks, one block per chunk:

- ``qwen3-next``: gated delta net layers 0, 1, 3 and full attention on layer 2, bfloat16; a state
  segment (three layers' conv and recurrent states) takes two host rows;
- ``granite-hybrid``: a Mamba2 layer then an attention layer, float32; a state takes one row.
  vLLM 0.32's CPU Mamba2 layer asks for a mid-prefill checkpoint that its CPU chunk scan does not
  produce, and crashes on the first prefill with prefix caching on (`IndexError` in
  `mamba_mixer2.py`). THE TEST WORKS AROUND IT IN-PROCESS: while the engine is built, `MambaMixer2`
  declares its KV cache spec without that checkpoint (`MambaBase.get_kv_cache_spec`), so vLLM's
  scheduler cuts prefills at block boundaries instead. kvtier itself patches nothing.

A prompt of about 250 tokens, `reset_prefix_cache()`, then a longer prompt sharing it: the prefix
comes back from the host tier, and from fs after host eviction, as the attention chunks up to the
hit point T plus the state segment at T; `kvtier fsck` then finds the fs directory clean.
Before the reload the whole device KV and state cache is overwritten with 7.0, so a load that
copied nothing fails; the reloaded pages and states are byte-identical to the stored ones, and the
greedy tokens (and logprobs within 1e-4) equal a run computed from scratch (kvtier's load and
store skipped, after a device cache reset).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.integrations.vllm.launch import transfer_config
from kvtier.state_rows import state_keys
from kvtier.tiers.fs.fsck import fsck
from tests.integrations.conftest import connector_halves
from tests.integrations.prompts import PROMPTS
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

ROW_BYTES = 65536  # one attention layer, K and V, 64 tokens: 4 heads of 64 in bf16, or 2 in float32
STATE_ROWS = {"qwen3-next": 2, "granite-hybrid": 1}
DTYPE = {"qwen3-next": "bfloat16", "granite-hybrid": "float32"}
KIND = {"qwen3-next": "gdn@0,1,3", "granite-hybrid": "mamba2@0"}
HOST_ROWS = 8  # one prompt and a half: three or four chunks and a two-row state each
TEXTS = {
    "first": PROMPTS["lighthouse"] + " " + PROMPTS["bread"],
    "second": PROMPTS["library"] + " " + PROMPTS["chess"],
    "filler1": PROMPTS["railway"] + " " + PROMPTS["garden"],
    "filler2": PROMPTS["birds"] + " " + PROMPTS["railway"],
    "filler3": PROMPTS["garden"] + " " + PROMPTS["bread"],
}
TAIL = " Answer in one sentence, then stop."
SCRATCH = {"kvtier": {"skip_load": True, "skip_store": True}}
POISON = 7.0


@dataclass(frozen=True)
class Result:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    cached: int


def generate(llm: Any, prompt: str, max_tokens: int = 6, scratch: bool = False) -> Result:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": SCRATCH} if scratch else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, extra_args=extra)
    done = llm.generate([prompt], params, use_tqdm=False)[0]
    out = done.outputs[0]
    logprobs = [entry[tok].logprob for tok, entry in zip(out.token_ids, out.logprobs, strict=True)]
    return Result(list(done.prompt_token_ids), list(out.token_ids), logprobs, done.num_cached_tokens)


@dataclass
class Engine:
    name: str
    llm: Any
    reference: dict[str, Result]
    fs_root: Path


@pytest.fixture(scope="module", params=sorted(STATE_ROWS))
def engine(
    request: pytest.FixtureRequest, vllm_env: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    from vllm import LLM
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    from kvtier.tools.tiny_models import build_tiny_model

    name = request.param
    fs_root = tmp_path_factory.mktemp("fs")
    config = {
        "cpu_bytes_to_use": HOST_ROWS * ROW_BYTES,
        "secondary_tiers": [{"type": "fs", "root_dir": str(fs_root)}],
    }
    with pytest.MonkeyPatch.context() as mp:
        if name == "granite-hybrid":  # the workaround of vLLM's CPU Mamba2 crash (module doc)
            mp.setattr(MambaMixer2, "get_kv_cache_spec", MambaBase.get_kv_cache_spec)
        llm = LLM(
            model=str(build_tiny_model(name)), kv_transfer_config=transfer_config(config),
            enforce_eager=True, dtype=DTYPE[name], block_size=64, enable_prefix_caching=True,
            kv_cache_memory_bytes=16 << 20, max_model_len=1024, max_num_seqs=2, seed=0,
        )
    reference = {}
    for text in ("first", "second"):
        reference[text] = generate(llm, TEXTS[text] + TAIL, scratch=True)
        assert reference[text].cached == 0
        llm.reset_prefix_cache()
    yield Engine(name, llm, reference, fs_root)
    llm.llm_engine.engine_core.shutdown()


def state_tensors(worker: Any) -> list[torch.Tensor]:
    return [t for parts in worker.states.copier.tensors for t in parts]


class Spy:
    """The device bytes of each attention chunk and state segment (by key) when the worker stores
    it and right after it loads it."""

    def __init__(self, worker: Any, mp: pytest.MonkeyPatch) -> None:
        self.stored: dict[bytes, bytes] = {}
        self.loaded: dict[bytes, bytes] = {}
        attention, states = worker.transfer.layer_tensors, worker.states.copier.tensors
        save, start_load = worker.save, worker.start_load

        def page(ids: tuple[int, ...]) -> bytes:
            pages = (kv[list(ids)].contiguous().view(torch.uint8) for kv in attention)
            return b"".join(p.numpy().tobytes() for p in pages)

        def state(ids: tuple[int, ...]) -> bytes:
            return b"".join(
                t[block].contiguous().view(torch.uint8).numpy().tobytes()
                for parts, block in zip(states, ids, strict=True) for t in parts
            )

        def spy_save(meta: Any) -> None:
            for job in meta.stores:
                self.stored.update((k, page(ids)) for k, ids in zip(job.keys, job.block_ids, strict=True))
            self.stored.update((job.keys[0], state(job.block_ids)) for job in meta.state_stores)
            save(meta)

        def spy_load(meta: Any) -> None:
            start_load(meta)
            for job in meta.loads:
                self.loaded.update((k, page(ids)) for k, ids in zip(job.keys, job.block_ids, strict=True))
            self.loaded.update((job.keys[0], state(job.block_ids)) for job in meta.state_loads)

        mp.setattr(worker, "save", spy_save)
        mp.setattr(worker, "start_load", spy_load)


@pytest.fixture
def spy(engine: Engine) -> Iterator[Spy]:
    with pytest.MonkeyPatch.context() as mp:
        yield Spy(connector_halves(engine.llm)[1], mp)


def loads(scheduler: Any, tier: str) -> float:
    return scheduler.manager.metrics.value("kvtier_transfer_chunks_total", tier=tier, op="load")


def reload_check(engine: Engine, spy: Spy, name: str, tier: str, evict: tuple[str, ...] = ()) -> None:
    llm = engine.llm
    scheduler, worker = connector_halves(llm)
    first = generate(llm, TEXTS[name], max_tokens=1)
    chunk = scheduler.geometry.chunk_tokens
    keys = scheduler.hasher.keys(first.prompt)[: (len(first.prompt) - 1) // chunk]
    assert len(keys) >= 3
    state = state_keys(scheduler.states.layout, keys[-1])
    assert len(state) == STATE_ROWS[engine.name]
    settle(scheduler)
    host = scheduler.manager.host
    assert all(host.contains(k) for k in [*keys, *state])
    for filler in evict:
        generate(llm, TEXTS[filler], max_tokens=1)
        settle(scheduler)
    if evict:
        held = [host.contains(k) for k in [*keys, *state]]
        assert not any(held), f"the fillers did not evict {held}"
    before = loads(scheduler, tier)

    assert llm.reset_prefix_cache()
    for tensor in [*worker.transfer.layer_tensors, *state_tensors(worker)]:
        tensor.fill_(POISON)
    again = generate(llm, TEXTS[name] + TAIL)

    assert again.cached == len(keys) * chunk
    assert loads(scheduler, tier) - before == len(keys) + len(state)  # rows: chunks and state
    ref = engine.reference[name]
    assert again.prompt == ref.prompt
    assert again.tokens == ref.tokens
    assert max(abs(a - b) for a, b in zip(again.logprobs, ref.logprobs, strict=True)) < 1e-4
    for key in [*keys, state[0]]:
        assert spy.loaded[key] == spy.stored[key]


def test_the_states_are_segments_of_the_recurrent_layers(engine: Engine) -> None:
    scheduler = connector_halves(engine.llm)[0]
    geometry = scheduler.geometry
    assert len(geometry.layer_names) == 1
    assert geometry.layout.row_bytes == ROW_BYTES
    assert dict(geometry.fingerprint.extra)["states"].startswith(KIND[engine.name])
    assert geometry.states.layout.rows == STATE_ROWS[engine.name]
    assert engine.llm.llm_engine.vllm_config.cache_config.mamba_cache_mode == "align"


def test_a_longer_prompt_reloads_the_prefix_and_state_from_the_host_tier(engine: Engine, spy: Spy) -> None:
    reload_check(engine, spy, "first", "host")


def test_a_longer_prompt_reloads_the_prefix_and_state_from_fs_after_host_eviction(
    engine: Engine, spy: Spy
) -> None:
    reload_check(engine, spy, "second", "fs", evict=("filler1", "filler2", "filler3"))
    report = fsck(str(engine.fs_root), repair=False)  # state rows are chunk files like any other
    assert not report.bad and report.good_files >= 4 + STATE_ROWS[engine.name]
