"""vLLM's `kv_role` on real engines (in-process, SmolLM2 float32) sharing one fs directory and a
p2p tier: a prefill instance (`kv_producer`) stores every prefix it computes through its tiers and
loads nothing, not even what its own host tier holds; a decode instance (`kv_consumer`, started
while the prefill instance still serves, with it as its p2p peer) reloads what the prefill
instance computed, from fs or from the prefill instance's host tier over p2p, and answers exactly
as it did, and keeps what it computes itself in its host tier only: no cascade reaches the fs
tier. Also `kvtier serve --kv-role`, which puts the role in the transfer config it starts vLLM
with."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.integrations.vllm.serving.launch import connector_config
from tests.integrations.conftest import _model_path, connector_halves
from tests.integrations.engine_steps import generate
from tests.integrations.shared_helpers import settle
from tests.integrations.test_vllm_tiers import CHUNK, LLM_ARGS, extra_config, tokens
from tests.services.redis_server import free_port

pytestmark = pytest.mark.slow


class _Engine:
    """An in-process engine with kvtier's connector in vLLM role `role`, on fs directory `fs_dir`,
    with a p2p tier of options `p2p`."""

    def __init__(self, role: str, fs_dir: Path, p2p: dict[str, Any]) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        extra = extra_config(fs_dir)
        extra["secondary_tiers"] = [*extra["secondary_tiers"], {"type": "p2p", **p2p}]
        transfer = KVTransferConfig(**{**connector_config(extra), "kv_role": role})
        self.llm = LLM(model=str(_model_path()), kv_transfer_config=transfer, **LLM_ARGS)
        self.scheduler = connector_halves(self.llm)[0]

    def serve(self, prompt: list[int], **kvtier: Any) -> Any:
        """Serve `prompt` (with kvtier request options `kvtier`) with vLLM's device prefix cache
        emptied first, then wait for its stores."""
        assert self.llm.reset_prefix_cache()
        done = generate(self.llm, prompt, **kvtier)
        settle(self.scheduler)
        return done

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engines(vllm_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The prefill instance's runs, then the decode instance's, on one fs directory; the decode
    instance starts while the prefill instance serves its host tier over p2p."""
    fs_dir = tmp_path_factory.mktemp("fs-roles")
    runs: dict[str, Any] = {"fs_dir": fs_dir}
    secret, listen = secrets.token_hex(16), f"tcp://127.0.0.1:{free_port()}"
    prefill = _Engine("kv_producer", fs_dir, {"secret": secret, "listen": listen})
    decode = None
    try:
        prompt = tokens(prefill.llm, "lighthouse")
        runs["prompt"], runs["other"] = prompt, tokens(prefill.llm, "bread")
        runs["p2p_prompt"] = tokens(prefill.llm, "birds")
        runs["first"] = prefill.serve(prompt)
        runs["held_by_prefill"] = all(prefill.scheduler.manager.host.contains(k)
                                      for k in prefill.scheduler.hasher.keys(prompt))
        runs["again"] = prefill.serve(prompt)
        runs["files_of_prompt"] = _chunk_files(fs_dir)
        runs["p2p_first"] = prefill.serve(runs["p2p_prompt"])
        decode = _Engine("kv_consumer", fs_dir, {"secret": secret, "peers": [listen]})
        runs["files_before"] = _chunk_files(fs_dir)
        runs["decoded"] = decode.serve(runs["prompt"], load_tiers=["fs"])
        runs["p2p_decoded"] = decode.serve(runs["p2p_prompt"], load_tiers=["p2p"])
        runs["own"] = decode.serve(runs["other"])
        manager = decode.scheduler.manager
        runs["own_in_host"] = all(manager.host.contains(k)
                                  for k in decode.scheduler.hasher.keys(runs["other"]))
        runs["files_after"] = _chunk_files(fs_dir)
        runs["decode_stores"] = manager.metrics.value("kvtier_transfer_chunks_total", tier="fs", op="store")
        yield runs
    finally:
        for engine in (decode, prefill):
            if engine is not None:
                engine.close()


def _chunk_files(root: Path) -> set[str]:
    return {path.name for path in root.rglob("*") if path.is_file() and len(path.name) == 64}


def test_a_prefill_instance_stores_through_its_tiers_and_loads_nothing(engines: dict[str, Any]) -> None:
    prompt, hit = engines["prompt"], (len(engines["prompt"]) - 1) // CHUNK * CHUNK
    assert engines["held_by_prefill"]  # its host tier held the prompt's chunks ...
    for run in (engines["first"], engines["again"]):  # ... yet it recomputed the prompt both times
        split = run.kv_transfer_params["kvtier"]["tokens"]
        assert split == {"device": 0, "host": 0, "fs": 0, "p2p": 0, "recomputed": len(prompt)}, split
    assert engines["again"].outputs[0].token_ids == engines["first"].outputs[0].token_ids
    assert len(engines["files_of_prompt"]) == hit // CHUNK  # and stored them through to fs


def test_a_decode_instance_reloads_what_prefill_computed_and_keeps_its_own_in_host(
    engines: dict[str, Any],
) -> None:
    prompt, hit = engines["prompt"], (len(engines["prompt"]) - 1) // CHUNK * CHUNK
    decoded = engines["decoded"]
    assert decoded.kv_transfer_params["kvtier"]["tokens"] == {
        "device": 0, "host": 0, "fs": hit, "p2p": 0, "recomputed": len(prompt) - hit}
    assert decoded.num_cached_tokens == hit
    assert decoded.outputs[0].token_ids == engines["first"].outputs[0].token_ids
    assert engines["own_in_host"]
    assert engines["files_after"] == engines["files_before"]  # nothing cascaded to fs
    assert engines["decode_stores"] == 0


def test_a_decode_instance_reloads_over_p2p_from_the_prefill_instances_host_tier(
    engines: dict[str, Any],
) -> None:
    prompt = engines["p2p_prompt"]
    hit = (len(prompt) - 1) // CHUNK * CHUNK
    decoded = engines["p2p_decoded"]
    assert decoded.kv_transfer_params["kvtier"]["tokens"] == {
        "device": 0, "host": 0, "fs": 0, "p2p": hit, "recomputed": len(prompt) - hit}
    assert decoded.num_cached_tokens == hit
    assert decoded.outputs[0].token_ids == engines["p2p_first"].outputs[0].token_ids


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kvtier_serve_starts_vllm_with_the_role(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--kv-role", role, "--dry-run"]) == 0
    printed = capsys.readouterr()
    line = next(ln for ln in (printed.out + printed.err).splitlines()
                if ln.startswith("--kv-transfer-config "))
    transfer = json.loads(line.split(" ", 1)[1].strip("'"))
    assert transfer["kv_role"] == role and transfer["kv_connector"] == "KVTierConnector"
