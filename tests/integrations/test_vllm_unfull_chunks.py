"""Chunks of 256 tokens on 32-token engine blocks (`chunk_tokens`), on a real engine (in-process,
SmolLM2 float32, a host tier and an fs tier).

A conversation's first turn ends inside its second chunk: the whole blocks it computed there are
stored when it finishes (its unfull chunk). The next turn, a longer prompt continuing it, reloads
its first chunk and those blocks, from the host tier and, once the host tier is emptied, from the
fs tier; its greedy answer is the one computed without kvtier, and each block it loaded holds the
bytes stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvtier.errors import ConfigError
from tests.conftest import wait_until
from tests.integrations.conftest import BLOCK_SIZE, connector_halves
from tests.integrations.kv_spy import KVSpy
from tests.integrations.prompts import PROMPTS
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

CHUNK = 256
TURN_ONE = CHUNK + 3 * BLOCK_SIZE + 20  # prompt tokens: one full chunk, three whole blocks, 20 more
REPLY = 8


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("fs")
    return make_llm({"cpu_bytes_to_use": 64 << 20, "chunk_tokens": CHUNK,
                     "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}, dtype="float32")


def test_the_next_turn_reloads_the_blocks_its_last_turn_ended_with(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import SamplingParams

    scheduler, worker = connector_halves(llm)
    assert (scheduler.geometry.chunk_tokens, scheduler.geometry.blocks_per_chunk) == (CHUNK, 8)
    spy = KVSpy(worker, monkeypatch)
    tokenizer = llm.get_tokenizer()
    text = " ".join(PROMPTS[k] for k in ("lighthouse", "bread", "library", "birds", "railway"))
    ids: list[int] = tokenizer.encode(text)
    assert len(ids) > TURN_ONE

    def generate(tokens: list[int], max_tokens: int, **options: bool) -> Any:
        extra = {"kv_transfer_params": {"kvtier": options}} if options else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
        return llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]

    def emptied() -> bool:
        """Steps the engine (a finished request's blocks are freed once its tail is stored) until
        its prefix cache could be emptied."""
        generate(ids[:2], 1, skip_load=True, skip_store=True)
        settle(scheduler)
        return bool(llm.reset_prefix_cache())

    def run(tokens: list[int], **options: bool) -> Any:
        out = generate(tokens, REPLY, **options)
        wait_until(emptied, "an empty device prefix cache", timeout_s=60)  # only kvtier serves next
        return out

    first = run(ids[:TURN_ONE])
    history = ids[:TURN_ONE] + list(first.outputs[0].token_ids)
    computed = len(history) - 1  # the last reply token's KV is never computed
    blocks = (computed - CHUNK) // BLOCK_SIZE
    assert 0 < blocks < 8
    unfull = scheduler.hasher.unfull_key(scheduler.hasher.keys(history)[0],
                                         history[CHUNK : CHUNK + blocks * BLOCK_SIZE])
    assert unfull in spy.stored and scheduler.manager.host.contains(unfull)
    reloadable = CHUNK + blocks * BLOCK_SIZE

    for source, follow_up in (("host", "chess"), ("fs", "garden")):
        prompt = history + tokenizer.encode(" " + PROMPTS[follow_up])
        reference = run(prompt, skip_load=True, skip_store=True)
        if source == "fs":
            scheduler.reset_cache()  # the host tier is empty: the fs tier serves
        again = run(prompt, skip_store=True)
        split = again.kv_transfer_params["kvtier"]["tokens"]
        assert split[source] == reloadable and split["device"] == 0
        assert again.outputs[0].token_ids == reference.outputs[0].token_ids
        loaded = spy.loaded[unfull]
        assert [b is None for b in loaded] == [False] * blocks + [True] * (8 - blocks)
        assert spy.written(unfull) == spy.stored[unfull][:blocks]


def test_a_chunk_size_the_engine_block_does_not_divide_is_refused(llm: Any) -> None:
    from kvtier.integrations.vllm.model.read_geometry import engine_geometry

    engine = llm.llm_engine.engine_core.engine_core
    with pytest.raises(ConfigError, match=r"chunk_tokens.*multiple of the engine's block size \(32"):
        engine_geometry(engine.vllm_config, engine.scheduler.kv_cache_config, 1, chunk_tokens=100)
