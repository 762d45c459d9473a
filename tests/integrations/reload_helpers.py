"""The steps the in-process reload tests of hybrid models share (`test_vllm_hybrid`,
`test_vllm_states`): greedy generation with logprobs, a spy on the worker half recording the device
bytes of every chunk and state segment it stores and loads, and the reload check itself (store a
prompt, optionally evict it from the host tier, reset the device prefix cache, serve it with a tail
and compare with a run from scratch).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvtier.format.layout import SKIP_BLOCK
from kvtier.format.state_rows import state_keys
from tests.integrations.conftest import connector_halves
from tests.integrations.shared_helpers import settle

TAIL = " Answer in one sentence, then stop."
SCRATCH = {"kvtier": {"skip_load": True, "skip_store": True}}


@dataclass(frozen=True)
class Result:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    cached: int


def generate(llm: Any, prompt: str, max_tokens: int = 6, scratch: bool = False) -> Result:
    """Greedy tokens for `prompt`, alone in the engine, with each token's logprob; `scratch`:
    kvtier neither loads nor stores."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": SCRATCH} if scratch else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, extra_args=extra)
    done = llm.generate([prompt], params, use_tqdm=False)[0]
    out = done.outputs[0]
    logprobs = [entry[tok].logprob for tok, entry in zip(out.token_ids, out.logprobs, strict=True)]
    return Result(list(done.prompt_token_ids), list(out.token_ids), logprobs, done.num_cached_tokens)


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())


class Spy:
    """Each attention layer's device bytes of each chunk (by key) when the worker stores it and
    after it loads it (a load records only the layers whose group holds blocks for the chunk), and
    each state segment's (by its first row key), for models with recurrent layers."""

    def __init__(self, worker: Any, mp: pytest.MonkeyPatch) -> None:
        self.stored: dict[bytes, dict[int, bytes]] = {}
        self.loaded: dict[bytes, dict[int, bytes]] = {}
        plan, tensors = worker.transfer.plan, worker.transfer.layer_tensors
        states = worker.transfer.states.tensors if worker.transfer.states is not None else []
        bpc = plan.blocks_per_chunk
        save, start_load = worker.save, worker.start_load

        def pages(ids: tuple[int, ...]) -> dict[int, bytes]:
            out = {}
            for layer, kv in enumerate(tensors):
                group = plan.layer_groups[layer]
                blocks = list(ids[group * bpc : (group + 1) * bpc])
                if SKIP_BLOCK not in blocks:
                    out[layer] = _bytes(kv[blocks])
            return out

        def state(ids: tuple[int, ...]) -> dict[int, bytes]:
            parts = (t[block] for layer, block in zip(states, ids, strict=True) for t in layer)
            return {0: b"".join(_bytes(part) for part in parts)}

        def record(into: dict[bytes, dict[int, bytes]], meta: Any, load: bool) -> None:
            for job in meta.loads if load else meta.stores:
                into.update((key, pages(ids)) for key, ids in zip(job.keys, job.block_ids, strict=True))
            for job in meta.state_loads if load else meta.state_stores:
                into[job.keys[0]] = state(job.block_ids)

        def spy_save(meta: Any) -> None:
            record(self.stored, meta, load=False)
            save(meta)

        def spy_load(meta: Any) -> None:
            start_load(meta)
            record(self.loaded, meta, load=True)

        mp.setattr(worker, "save", spy_save)
        mp.setattr(worker, "start_load", spy_load)

    def check(self, keys: list[bytes], kinds: tuple[str, ...], states: Iterable[bytes] = ()) -> None:
        """Every reloaded page equals the stored one; the pages of every chunk were loaded, but
        sliding-window pages only for the chunks in the window before the hit point (64 tokens:
        the last two chunks of 32); so was each state segment keyed in `states`."""
        for i, key in enumerate(keys):
            in_window = i >= len(keys) - 2
            expected = {layer for layer, kind in enumerate(kinds) if in_window or "sliding" not in kind}
            assert set(self.loaded[key]) == expected, (i, kinds)
            assert set(self.stored[key]) == set(range(len(kinds)))
            for layer in expected:
                assert self.loaded[key][layer] == self.stored[key][layer], (i, layer)
        for key in states:
            assert self.loaded[key] == self.stored[key]


def loads(scheduler: Any, tier: str) -> float:
    """Rows (chunks and state rows) loaded from `tier` so far."""
    return scheduler.manager.metrics.value("kvtier_transfer_chunks_total", tier=tier, op="load")


def reload_check(llm: Any, spy: Spy, prompt: str, reference: Result, tier: str, fillers: tuple[str, ...] = (),
                 tolerance: float = 1e-4, poison: float | None = None) -> None:
    """Store `prompt`, evict it from the host tier with `fillers` (prompts) when given, reset the
    device prefix cache (and, `poison`, fill every device KV and state tensor with it, so a load
    that copied nothing fails), then serve `prompt + TAIL`: its prefix (attention chunks and, for a
    recurrent model, the state at their end) comes back from `tier`, the device bytes equal the
    stored ones, and the tokens and logprobs (within `tolerance`) equal the run from scratch
    `reference`."""
    scheduler, worker = connector_halves(llm)
    first = generate(llm, prompt, max_tokens=1)
    chunk = scheduler.geometry.chunk_tokens
    keys = scheduler.hasher.keys(first.prompt)[: (len(first.prompt) - 1) // chunk]
    assert len(keys) >= 3
    states = state_keys(scheduler.geometry.states.layout, keys[-1]) if scheduler.geometry.states else []
    settle(scheduler)
    host = scheduler.manager.host
    assert all(host.contains(k) for k in [*keys, *states])
    for filler in fillers:
        generate(llm, filler, max_tokens=1)
        settle(scheduler)
    if fillers:
        held = [host.contains(k) for k in [*keys, *states]]
        assert not any(held), f"the fillers did not evict {held}"
    before = loads(scheduler, tier)

    llm.reset_prefix_cache()
    if poison is not None:
        state_tensors = [t for parts in worker.transfer.states.tensors for t in parts] if states else []
        for tensor in [*worker.transfer.layer_tensors, *state_tensors]:
            tensor.fill_(poison)
    again = generate(llm, prompt + TAIL)

    assert again.cached == len(keys) * chunk
    assert loads(scheduler, tier) - before == len(keys) + len(states)  # rows: chunks and state
    assert again.prompt == reference.prompt
    assert again.tokens == reference.tokens
    assert max(abs(a - b) for a, b in zip(again.logprobs, reference.logprobs, strict=True)) < tolerance
    spy.check(keys, scheduler.geometry.layout.kinds, states[:1])
