"""Real tensor parallelism on vLLM's CPU backend (one core per rank): chunks stored by a TP=1 engine
reload into a TP=2 engine, and the reverse, through an fs directory.

Tiny random-weight float32 models (`kvtier.tools.tiny_models`) whose KV head counts 2 divides:
``llama`` (full attention, 4 KV heads), ``gemma3`` (sliding window + full attention, 2 KV heads),
``mistral-sliding`` (every layer slides, 2 KV heads) and ``deepseek-v2`` (MLA: one latent row per
token, which every rank holds whole). Per model, three engines, one after the other, each in its
own process (`tp_engine`):

1. TP=1 serves the longer prompts from scratch (its references), then stores prompts P and Q;
2. TP=2, on a directory holding only TP=1's chunks of P, reloads P for P + tail, then stores Q;
3. TP=1, on a directory holding only TP=2's chunks of Q, reloads Q for Q + tail.

What proves the format TP-independent is exact: each TP=2 rank's reloaded device pages are its
heads of TP=1's stored pages (an MLA latent: all of it), and TP=1's reloaded pages are TP=2's
ranks' stored pages put together, byte for byte. The chunk files of Q written by TP=1 and by TP=2
have the same names (keys), headers (layout fingerprint, length) and first-layer bytes; their later
layers differ, because the values do: TP=2 sums its ranks' partial products in another order (an
all-reduce), which changes their last bits, and vLLM's CPU MLA differs between TP degrees by a few
percent of a latent value (both TP degrees are that far from transformers' own DeepSeek-V2). So the
reloads' greedy tokens equal a run from scratch of the reloading engine, and their logprobs are
within 1e-4 of it (MLA: 5e-3; the two TP degrees' logprobs differ by 1.6e-3, and vLLM's MLA attends
a prefill with a cached prefix by another path than a whole prefill, 8e-4 apart on one engine).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.tiers.common import chunkfmt
from tests.integrations.prompts import PROMPTS
from tests.integrations.tp_engine import Pages, Served, Step, rank_pages, run_engine

pytestmark = pytest.mark.slow

TAIL = " Answer in one sentence, then stop."
BLOCK = {"llama": 32, "gemma3": 32, "mistral-sliding": 32, "deepseek-v2": 16}
LATENT = {"deepseek-v2"}
LOGPROB_ATOL = {"deepseek-v2": 5e-3}
_CHECKSUM_AT = chunkfmt._FIXED.size - 16
"""Where the payload checksum starts in a chunk header (its last fixed field)."""


def llm_options(name: str) -> dict[str, Any]:
    return {
        "enforce_eager": True,
        "block_size": BLOCK[name],
        "dtype": "float32",
        "kv_cache_memory_bytes": 8 << 20,
        "max_model_len": 256,
        "max_num_seqs": 2,
        "seed": 0,
    }


def stored_keys(served: Served) -> list[str]:
    """The keys of the chunks a prompt stores: its full chunks short of its last token."""
    return served.keys[: (len(served.prompt) - 1) // served.chunk_tokens]


def chunk_files(root: Path, keys: list[str]) -> dict[str, Path]:
    """Each key's chunk file under fs root `root`, by its path relative to the root."""
    found = {path.name: path for path in root.glob("*/*/*") if path.is_file()}
    assert set(keys) <= set(found), "chunks missing from the fs directory"
    return {str(found[key].relative_to(root)): found[key] for key in keys}


def copy_chunks(src: Path, dst: Path, keys: list[str]) -> None:
    dst.mkdir()
    for rel, path in chunk_files(src, keys).items():
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dst / rel)


def assert_reloaded(name: str, served: Served, reference: Served, keys: list[str]) -> None:
    """`served` reloaded `keys` from fs and matches the run from scratch `reference`."""
    reused = len(keys) * served.chunk_tokens
    assert served.split["fs"] == reused, served.split
    assert served.cached == reused
    assert served.prompt == reference.prompt
    assert served.tokens == reference.tokens
    atol = LOGPROB_ATOL.get(name, 1e-4)
    assert np.allclose(served.logprobs, reference.logprobs, rtol=0, atol=atol), (
        served.logprobs, reference.logprobs)


def shard(page: np.ndarray, rank: int, tp: int, latent: bool) -> np.ndarray:
    """Rank `rank`'s part of a TP=1 page: its KV heads (axis 1), or the whole MLA latent."""
    return page if latent else np.split(page, tp, axis=1)[rank]


def assert_pages_moved(src: list[Pages], dst: list[Pages], keys: list[str], latent: bool) -> None:
    """Every page `dst`'s ranks loaded for `keys` is, byte for byte, what `src`'s ranks stored, cut
    or joined along the KV heads for the other TP degree; every layer of each key was loaded by
    some chunk (sliding-window layers only for the window's)."""
    loaded_layers = set()
    for key in keys:
        layers = {layer for op, k, layer in dst[0] if op == "load" and k == key}
        loaded_layers |= layers
        for layer in layers:
            if len(src) == 1:
                whole = src[0][("store", key, layer)]
                parts = [shard(whole, rank, len(dst), latent) for rank in range(len(dst))]
            else:
                parts = [src[rank][("store", key, layer)] for rank in range(len(src))]
                joined = parts[0] if latent else np.concatenate(parts, axis=1)
                parts = [joined]
            for rank, part in enumerate(parts):
                assert dst[rank][("load", key, layer)].tobytes() == part.tobytes(), (key, layer, rank)
    assert loaded_layers == {layer for op, k, layer in src[0] if op == "store" and k == keys[0]}


def assert_same_files(tp1: dict[str, Path], tp2: dict[str, Path], first_layer_bytes: int) -> None:
    assert set(tp1) == set(tp2)  # same keys under the same layout fingerprint directory
    head = chunkfmt.HEADER_BYTES
    for rel in tp1:
        one, two = tp1[rel].read_bytes(), tp2[rel].read_bytes()
        assert len(one) == len(two)
        assert one[:_CHECKSUM_AT] == two[:_CHECKSUM_AT]  # magic, version, key, layout, length
        assert one[head : head + first_layer_bytes] == two[head : head + first_layer_bytes], rel


def first_layer_bytes(name: str, block: int) -> int:
    """Bytes of layer 0 in a row of one block (float32): K then V of every head, or one latent."""
    if name in LATENT:
        return block * 576 * 4
    heads = 4 if name == "llama" else 2
    return 2 * heads * block * 64 * 4


@pytest.mark.parametrize("name", sorted(BLOCK))
def test_tp2_reloads_what_tp1_stored_and_the_reverse(name: str, vllm_env: Path, tmp_path: Path) -> None:
    from kvtier.tools.tiny_models import build_tiny_model

    model, options, latent = build_tiny_model(name), llm_options(name), name in LATENT
    p, q = PROMPTS["lighthouse"], PROMPTS["bread"]

    fs1, out1 = tmp_path / "fs-tp1", tmp_path / "tp1"
    _, ref_q1, stored_p, stored_q = run_engine(model, 1, fs1, options, [
        Step(p + TAIL, scratch=True), Step(q + TAIL, scratch=True), Step(p, max_tokens=1),
        Step(q, max_tokens=1)], out1)
    p_keys, q_keys = stored_keys(stored_p), stored_keys(stored_q)
    assert len(p_keys) >= 3 and len(q_keys) >= 3

    fs2, out2 = tmp_path / "fs-tp2", tmp_path / "tp2"
    copy_chunks(fs1, fs2, p_keys)
    ref_p2, reloaded_p, _ = run_engine(model, 2, fs2, options, [
        Step(p + TAIL, scratch=True), Step(p + TAIL), Step(q, max_tokens=1)], out2)
    assert_reloaded(name, reloaded_p, ref_p2, p_keys)
    assert_pages_moved(rank_pages(out1, 1), rank_pages(out2, 2), p_keys, latent)
    first = first_layer_bytes(name, BLOCK[name])
    assert_same_files(chunk_files(fs1, q_keys), chunk_files(fs2, q_keys), first)

    fs3, out3 = tmp_path / "fs-tp1-again", tmp_path / "tp1-again"
    copy_chunks(fs2, fs3, q_keys)
    (reloaded_q,) = run_engine(model, 1, fs3, options, [Step(q + TAIL)], out3)
    assert_reloaded(name, reloaded_q, ref_q1, q_keys)
    assert_pages_moved(rank_pages(out2, 2), rank_pages(out3, 1), q_keys, latent)
