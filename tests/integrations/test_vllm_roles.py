"""vLLM's `kv_role` on real engines (in-process, SmolLM2 float32) sharing one fs directory, one
after the other: a prefill instance (`kv_producer`) stores every prefix it computes through its
tiers and loads nothing, not even what its own host tier holds; a decode instance (`kv_consumer`)
reloads what the prefill instance computed and answers exactly as it did, and keeps what it
computes itself in its host tier only: no cascade reaches the fs tier. Also `kvtier serve
--kv-role`, which puts the role in the transfer config it starts vLLM with."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.integrations.vllm.serving.launch import connector_config
from tests.integrations.conftest import _model_path, connector_halves
from tests.integrations.shared_helpers import settle
from tests.integrations.test_vllm_tiers import CHUNK, LLM_ARGS, extra_config, generate, tokens

pytestmark = pytest.mark.slow


class _Engine:
    """An in-process engine with kvtier's connector in vLLM role `role`, on fs directory `fs_dir`."""

    def __init__(self, role: str, fs_dir: Path) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        transfer = KVTransferConfig(**{**connector_config(extra_config(fs_dir)), "kv_role": role})
        self.llm = LLM(model=str(_model_path()), kv_transfer_config=transfer, **LLM_ARGS)
        self.scheduler = connector_halves(self.llm)[0]

    def serve(self, prompt: list[int]) -> Any:
        """Serve `prompt` with vLLM's device prefix cache emptied first, then wait for its stores."""
        assert self.llm.reset_prefix_cache()
        done = generate(self.llm, prompt)
        settle(self.scheduler)
        return done

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engines(vllm_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The prefill instance's runs, then the decode instance's, on one fs directory."""
    fs_dir = tmp_path_factory.mktemp("fs-roles")
    runs: dict[str, Any] = {"fs_dir": fs_dir}
    prefill = _Engine("kv_producer", fs_dir)
    try:
        prompt = tokens(prefill.llm, "lighthouse")
        runs["prompt"], runs["other"] = prompt, tokens(prefill.llm, "bread")
        runs["first"] = prefill.serve(prompt)
        runs["held_by_prefill"] = all(prefill.scheduler.manager.host.contains(k)
                                      for k in prefill.scheduler.hasher.keys(prompt))
        runs["again"] = prefill.serve(prompt)
    finally:
        prefill.close()
    decode = _Engine("kv_consumer", fs_dir)
    try:
        runs["files_before"] = _chunk_files(fs_dir)
        runs["decoded"] = decode.serve(runs["prompt"])
        runs["own"] = decode.serve(runs["other"])
        manager = decode.scheduler.manager
        runs["own_in_host"] = all(manager.host.contains(k)
                                  for k in decode.scheduler.hasher.keys(runs["other"]))
        runs["files_after"] = _chunk_files(fs_dir)
        runs["decode_stores"] = manager.metrics.value("kvtier_transfer_chunks_total", tier="fs", op="store")
        yield runs
    finally:
        decode.close()


def _chunk_files(root: Path) -> set[str]:
    return {path.name for path in root.rglob("*") if path.is_file() and len(path.name) == 64}


def test_a_prefill_instance_stores_through_its_tiers_and_loads_nothing(engines: dict[str, Any]) -> None:
    prompt, hit = engines["prompt"], (len(engines["prompt"]) - 1) // CHUNK * CHUNK
    assert engines["held_by_prefill"]  # its host tier held the prompt's chunks ...
    for run in (engines["first"], engines["again"]):  # ... yet it recomputed the prompt both times
        split = run.kv_transfer_params["kvtier"]["tokens"]
        assert split == {"device": 0, "host": 0, "fs": 0, "recomputed": len(prompt)}, split
    assert engines["again"].outputs[0].token_ids == engines["first"].outputs[0].token_ids
    assert len(engines["files_before"]) == hit // CHUNK  # and stored them through to fs


def test_a_decode_instance_reloads_what_prefill_computed_and_keeps_its_own_in_host(
    engines: dict[str, Any],
) -> None:
    prompt, hit = engines["prompt"], (len(engines["prompt"]) - 1) // CHUNK * CHUNK
    decoded = engines["decoded"]
    assert decoded.kv_transfer_params["kvtier"]["tokens"] == {
        "device": 0, "host": 0, "fs": hit, "recomputed": len(prompt) - hit}
    assert decoded.num_cached_tokens == hit
    assert decoded.outputs[0].token_ids == engines["first"].outputs[0].token_ids
    assert engines["own_in_host"]
    assert engines["files_after"] == engines["files_before"]  # nothing cascaded to fs
    assert engines["decode_stores"] == 0


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kvtier_serve_starts_vllm_with_the_role(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--kv-role", role, "--dry-run"]) == 0
    printed = capsys.readouterr()
    line = next(ln for ln in (printed.out + printed.err).splitlines()
                if ln.startswith("--kv-transfer-config "))
    transfer = json.loads(line.split(" ", 1)[1].strip("'"))
    assert transfer["kv_role"] == role and transfer["kv_connector"] == "KVTierConnector"
