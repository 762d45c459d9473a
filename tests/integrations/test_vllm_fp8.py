"""An fp8 KV cache (`kv_cache_dtype="fp8_e4m3"`) on vLLM's CPU backend (it needs AVX-512 or AMX),
tiny random-weight Llama (`tiny_models` "llama", float32 weights), engines one after the other in
the test's process (`tp_engine.LocalEngine`), each fresh, on one fs directory:

1. fp8: a prompt's chunks are stored as the engine holds them (one byte per value: a quarter of the
   float32 row) and reload from the host tier byte for byte into a longer prompt, with the greedy
   tokens and logprobs of a run from scratch;
2. float32 KV on the same directory: nothing of the fp8 chunks is loaded (other keys, another
   layout directory), the prefix is recomputed;
3. fp8 again, fresh: the longer prompt's chunks reload from fs, with step 1's tokens and logprobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.tiers.common import chunkfmt
from tests.integrations.prompts import PROMPTS
from tests.integrations.tp_engine import LocalEngine, Served, Step, rank_pages
from tests.optional import FP8_CPU_KERNELS

pytestmark = pytest.mark.slow

TAIL = " Answer in one sentence, then stop."
LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 4, 64, 32


def options(kv_cache_dtype: str) -> dict[str, Any]:
    return {"enforce_eager": True, "block_size": BLOCK, "dtype": "float32", "kv_cache_dtype": kv_cache_dtype,
            "kv_cache_memory_bytes": 8 << 20, "max_model_len": 256, "max_num_seqs": 2, "seed": 0}


def serve(model: Path, fs: Path, llm: dict[str, Any], steps: list[Step], out_dir: Path) -> list[Served]:
    """`steps` on a fresh engine, shut down before this returns."""
    with LocalEngine(model, fs, llm) as engine:
        return engine.serve(steps, out_dir)


def full_chunks(served: Served) -> list[str]:
    """The keys of the chunks a prompt stores: its full chunks short of its last token."""
    return served.keys[: (len(served.prompt) - 1) // served.chunk_tokens]


def reused(served: Served, keys: list[str]) -> None:
    assert served.cached == len(keys) * served.chunk_tokens


def same_run(served: Served, reference: Served) -> None:
    assert served.tokens == reference.tokens
    assert np.allclose(served.logprobs, reference.logprobs, rtol=0, atol=1e-4)


def test_fp8_chunks_are_stored_as_they_are_and_never_load_into_a_float32_engine(
    vllm_env: Path, tmp_path: Path
) -> None:
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        FP8_CPU_KERNELS.skip()
    from kvtier.tools.tiny_models import build_tiny_model

    model, fs = build_tiny_model("llama"), tmp_path / "fs"
    p, longer = PROMPTS["lighthouse"], PROMPTS["lighthouse"] + TAIL

    ref, stored, reloaded = serve(model, fs, options("fp8_e4m3"), [
        Step(longer, scratch=True), Step(p, max_tokens=1), Step(longer)], tmp_path / "fp8")
    keys = full_chunks(stored)
    assert len(keys) >= 3
    reused(reloaded, keys)
    assert reloaded.split["host"] == reloaded.cached
    same_run(reloaded, ref)
    (pages,) = rank_pages(tmp_path / "fp8", 1)
    for key in keys:
        for layer in range(LAYERS):
            page = pages[("store", key, layer)]
            assert page.dtype == np.uint8 and page.size == 2 * HEADS * BLOCK * HEAD_DIM  # a byte a value
            assert pages[("load", key, layer)].tobytes() == page.tobytes()
    (layout_dir,) = [d for d in fs.iterdir() if d.is_dir()]
    files = {path.name: path for path in layout_dir.glob("*/*")}
    assert set(keys) <= set(files)
    row = LAYERS * 2 * HEADS * BLOCK * HEAD_DIM
    assert all(files[key].stat().st_size == chunkfmt.HEADER_BYTES + row for key in keys)

    (as_float32,) = serve(model, fs, options("auto"), [Step(longer)], tmp_path / "float32")
    assert as_float32.cached == 0 and as_float32.split["fs"] == 0, as_float32.split
    assert not set(as_float32.keys) & set(keys)
    assert len([d for d in fs.iterdir() if d.is_dir()]) == 2  # its chunks went to their own layout

    (again,) = serve(model, fs, options("fp8_e4m3"), [Step(longer)], tmp_path / "fp8-again")
    reused(again, full_chunks(reloaded))  # step 1 stored the longer prompt's last chunk too
    assert again.split["fs"] == again.cached
    same_run(again, ref)
