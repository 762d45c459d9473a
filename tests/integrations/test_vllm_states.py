"""Real vLLM (CPU backend, in-process, prefix caching on: `mamba_cache_mode` "align") on tiny
random-weight recurrent hybrids (`kvtier.tools.tiny_models`), 64-token blocks, one block per chunk:

- ``qwen3-next``: gated delta net layers 0, 1, 3 and full attention on layer 2, bfloat16, with its
  recurrent states in float32 (`mamba_ssm_cache_dtype`: what vLLM picks itself on CPUs with
  AVX512-BF16, named here so every CPU runs one layout); a state segment (three layers' conv and
  recurrent states) takes two host rows;
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

from kvtier.integrations.vllm.serving.launch import transfer_config
from kvtier.tiers.fs.fsck import fsck
from tests.integrations.conftest import connector_halves
from tests.integrations.prompts import PROMPTS
from tests.integrations.reload_helpers import TAIL, Result, Spy, generate, reload_check

pytestmark = pytest.mark.slow

ROW_BYTES = 65536  # one attention layer, K and V, 64 tokens: 4 heads of 64 in bf16, or 2 in float32
STATE_ROWS = {"qwen3-next": 2, "granite-hybrid": 1}
DTYPE = {"qwen3-next": "bfloat16", "granite-hybrid": "float32"}
SSM_DTYPE = {"qwen3-next": "float32", "granite-hybrid": "auto"}
KIND = {"qwen3-next": "gdn@0,1,3", "granite-hybrid": "mamba2@0"}
HOST_ROWS = 8  # one prompt and a half: three or four chunks and a two-row state each
TEXTS = {
    "first": PROMPTS["lighthouse"] + " " + PROMPTS["bread"],
    "second": PROMPTS["library"] + " " + PROMPTS["chess"],
    "filler1": PROMPTS["railway"] + " " + PROMPTS["garden"],
    "filler2": PROMPTS["birds"] + " " + PROMPTS["railway"],
    "filler3": PROMPTS["garden"] + " " + PROMPTS["bread"],
}
POISON = 7.0


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
            enforce_eager=True, dtype=DTYPE[name], mamba_ssm_cache_dtype=SSM_DTYPE[name],
            block_size=64, enable_prefix_caching=True,
            kv_cache_memory_bytes=16 << 20, max_model_len=1024, max_num_seqs=2, seed=0,
        )
    reference = {}
    for text in ("first", "second"):
        reference[text] = generate(llm, TEXTS[text] + TAIL, scratch=True)
        assert reference[text].cached == 0
        llm.reset_prefix_cache()
    yield Engine(name, llm, reference, fs_root)
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture
def spy(engine: Engine) -> Iterator[Spy]:
    with pytest.MonkeyPatch.context() as mp:
        yield Spy(connector_halves(engine.llm)[1], mp)


def check(engine: Engine, spy: Spy, name: str, tier: str, evict: tuple[str, ...] = ()) -> None:
    """TEXTS[name]'s prefix and the state at its end come back from `tier` (after `evict`'s texts)."""
    reload_check(engine.llm, spy, TEXTS[name], engine.reference[name], tier,
                 fillers=tuple(TEXTS[f] for f in evict), poison=POISON)


def test_the_states_are_segments_of_the_recurrent_layers(engine: Engine) -> None:
    scheduler = connector_halves(engine.llm)[0]
    geometry = scheduler.geometry
    assert len(geometry.layer_names) == 1
    assert geometry.layout.row_bytes == ROW_BYTES
    assert dict(geometry.fingerprint.extra)["states"].startswith(KIND[engine.name])
    assert geometry.states.layout.rows == STATE_ROWS[engine.name]
    assert engine.llm.llm_engine.vllm_config.cache_config.mamba_cache_mode == "align"


def test_a_longer_prompt_reloads_the_prefix_and_state_from_the_host_tier(engine: Engine, spy: Spy) -> None:
    check(engine, spy, "first", "host")


def test_a_longer_prompt_reloads_the_prefix_and_state_from_fs_after_host_eviction(
    engine: Engine, spy: Spy
) -> None:
    check(engine, spy, "second", "fs", evict=("filler1", "filler2", "filler3"))
    report = fsck(str(engine.fs_root), repair=False)  # state rows are chunk files like any other
    assert not report.bad and report.good_files >= 4 + STATE_ROWS[engine.name]
