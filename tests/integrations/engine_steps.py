"""Steps of the tests that drive an in-process engine (`conftest.make_llm`): one greedy request
with kvtier's per-request options, and a prompt's chunks pushed out of the host tier by fillers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.integrations.conftest import connector_halves
from tests.integrations.shared_helpers import settle

FILLERS = ("library", "birds", "railway", "chess")
"""Prompts (`prompts.PROMPTS`) the tests never reuse: run one by one, they push other chunks out of
a small host tier."""


def generate(llm: Any, prompt: list[int], max_tokens: int = 6, **kvtier: Any) -> Any:
    """One greedy request for the token ids `prompt`, with `kvtier` as its kvtier options
    (`kv_transfer_params`); returns vLLM's output for it."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"kvtier": kvtier}} if kvtier else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def evict_host(llm: Any, keys: list[bytes], filler: Callable[[str], list[int]]) -> None:
    """Run the filler prompts (`filler(name)`: their token ids) one at a time, each after the tier
    jobs settled, until the host tier holds none of `keys`; fails the test if they do not suffice."""
    scheduler, _ = connector_halves(llm)
    for name in FILLERS:
        settle(scheduler)
        if not any(scheduler.manager.host.contains(k) for k in keys):
            break
        generate(llm, filler(name), max_tokens=1)
    settle(scheduler)
    assert not any(scheduler.manager.host.contains(k) for k in keys)
