"""Real tensor parallelism on vLLM's CPU backend (one core per rank): chunks stored by a TP=1 engine
reload into a TP=2 engine, and the reverse, through an fs directory.

Tiny random-weight models (`kvtier.tools.tiny_models`) whose head counts 2 divides, float32:
``llama`` (full attention, 4 KV heads), ``gemma3`` (sliding window + full attention, 2 KV heads),
``mistral-sliding`` (every layer slides, 2 KV heads), ``deepseek-v2`` (MLA: one latent row per
token, which every rank holds whole) and ``granite-hybrid`` (a Mamba2 layer, 4 heads and one group,
then attention; THE TEST'S PROCESS WORKS AROUND vLLM's CPU Mamba2 crash, `tp_engine`), and
``qwen3-next`` (gated delta net, 2 key and 2 value heads, beside attention; bfloat16). The two
recurrent hybrids reuse 64-token chunks of longer prompts, with the state at the hit point. Per
model, three engines one after the other (`tp_engine`: engine cores in the test's process; TP=2's
ranks in processes of their own, one per rank) and three phases:

1. TP=1 serves the longer prompts from scratch (its references), then stores prompts P and Q;
2. TP=2, on a directory holding only TP=1's chunks of P, reloads P for P + tail, then stores Q;
3. a fresh TP=1 engine (an empty host tier) on TP=1's fs directory, its chunks of Q replaced by
   TP=2's (the same file names), reloads Q for Q + tail: every byte it reloads is TP=2's.

What proves the format TP-independent is exact: each TP=2 rank's reloaded device pages are its
heads of TP=1's stored pages (an MLA latent: all of it), and TP=1's reloaded pages are TP=2's
ranks' stored pages put together, byte for byte. Recurrent states likewise: each TP=2 rank's
reloaded state is its shard of TP=1's stored state, and TP=1's reloaded state is TP=2's shards put
together, cut and joined here by hand as vLLM cuts them (`SECTIONS`). The chunk files of Q written
by TP=1 and by TP=2 have the same names (keys), headers (layout fingerprint, length) and
first-layer bytes (of a state row: the first recurrent layer's conv state, every channel in
canonical order; the hybrids' attention layers follow a recurrent one: none); their later layers
differ, because the values do: TP=2 sums its ranks' partial products in another order (an
all-reduce), which changes their last bits, and vLLM's CPU MLA differs between TP degrees by a few
percent of a latent value (both TP degrees are that far from transformers' own DeepSeek-V2). So the
reloads' greedy tokens equal a run from scratch of the reloading engine, and their logprobs are
within 1e-4 of it (MLA: 5e-3; the two TP degrees' logprobs differ by 1.6e-3, and vLLM's MLA attends
a prefill with a cached prefix by another path than a whole prefill, 8e-4 apart on one engine; the
bf16 model on a CPU with AMX: 1e-2, see `LOGPROB_ATOL`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.format.state_rows import state_key
from kvtier.tiers.common import chunkfmt
from tests.integrations.prompts import PROMPTS
from tests.integrations.tp_engine import LocalEngine, Pages, Served, Step, rank_pages

pytestmark = pytest.mark.slow

TAIL = " Answer in one sentence, then stop."
BLOCK = {"llama": 32, "gemma3": 32, "mistral-sliding": 32, "deepseek-v2": 16, "qwen3-next": 64,
         "granite-hybrid": 64}
LATENT = {"deepseek-v2"}
MLA_BACKEND = {"deepseek-v2": {"attention_backend": "CPU_MLA"}}
"""On a CPU with AMX tiles vLLM picks AMX_MLA, which takes bf16 weights only: name CPU_MLA."""
SECTIONS = {"qwen3-next": ((128, False),) * 3, "granite-hybrid": ((256, False), (16, True), (16, True))}
"""The recurrent models' conv-state channels (canonical rows), in order, and whether every rank holds
the section whole: gated delta net q, k, v (2 heads of 64 each); Mamba2 x (4 heads of 64), then B
and C (one group of d_state 16: vLLM gives it to every rank). Recurrent states split by heads."""
CONV_BYTES = {"qwen3-next": 384 * 3 * 2, "granite-hybrid": 288 * 3 * 4}
"""Bytes of the first recurrent layer's conv state (kernel 4: 3 positions per channel)."""
LOGPROB_ATOL = {"deepseek-v2": 5e-3, "qwen3-next": 1e-2}
NEAR_TIES = {"qwen3-next"}
"""Models whose greedy tokens may part at a near tie (`_agreeing_prefix`): the bf16 one."""
"""qwen3-next runs in bfloat16: on a CPU with AMX tiles vLLM's bf16 matmuls take the AMX path, where
a reload's prefill (the tail alone) and a whole prefill round differently, 3.9e-3 (2^-8, one bf16
step at these magnitudes) apart on an AMX machine; within 1e-4 on CPUs without AMX."""
_CHECKSUM_AT = chunkfmt._FIXED.size - 16
"""Where the payload checksum starts in a chunk header (its last fixed field)."""


def llm_options(name: str) -> dict[str, Any]:
    return {
        "enforce_eager": True,
        "block_size": BLOCK[name],
        "dtype": "bfloat16" if name == "qwen3-next" else "float32",
        # vLLM keeps gated delta net states in float32 on CPUs with AVX512-BF16 and in the model's
        # dtype elsewhere: named, so the state rows are the same on every CPU.
        **({"mamba_ssm_cache_dtype": "float32"} if name == "qwen3-next" else {}),
        "kv_cache_memory_bytes": (16 if name in SECTIONS else 8) << 20,
        "max_model_len": 512 if name in SECTIONS else 256,
        "max_num_seqs": 2,
        "seed": 0,
        **MLA_BACKEND.get(name, {}),
    }


def with_state(served: Served, keys: list[str]) -> list[str]:
    """`keys` and, for a recurrent model, the rows of the state at the end of the last of them."""
    last = bytes.fromhex(keys[-1])
    return keys + [state_key(last, j).hex() for j in range(served.state_rows)]


def cut(whole: np.ndarray, sections: tuple[tuple[int, bool], ...], rank: int, tp: int) -> np.ndarray:
    """Rank `rank`'s shard of a whole state part (rows on axis 0), section by section."""
    pieces, start = [], 0
    for rows, replicated in sections:
        size = rows if replicated else rows // tp
        begin = start if replicated else start + rank * size
        pieces.append(whole[begin : begin + size])
        start += rows
    return np.concatenate(pieces)


def join(shards: list[np.ndarray], sections: tuple[tuple[int, bool], ...]) -> np.ndarray:
    """The whole state part from its ranks' shards (a replicated section: the first rank's)."""
    pieces, local = [], 0
    for rows, replicated in sections:
        size = rows if replicated else rows // len(shards)
        owners = shards[:1] if replicated else shards
        pieces += [shard[local : local + size] for shard in owners]
        local += size
    return np.concatenate(pieces)


def assert_states_moved(name: str, src: list[Pages], dst: list[Pages], key: str) -> None:
    """Every state part `dst`'s ranks loaded for the state keyed `key` is, byte for byte, what
    `src`'s ranks stored, cut or joined for the other TP degree."""
    indices = sorted(i for op, k, i in src[0] if op == "store-state" and k == key)
    assert indices and indices == sorted(i for op, k, i in dst[0] if op == "load-state" and k == key)
    for i in indices:
        stored = [ranks[("store-state", key, i)] for ranks in src]
        heads = stored[0].shape[0] * len(src)
        sections = SECTIONS[name] if i % 2 == 0 else ((heads, False),)
        if len(src) == 1:
            want = [cut(stored[0], sections, rank, len(dst)) for rank in range(len(dst))]
        else:
            want = [join(stored, sections)]
        for rank, part in enumerate(want):
            assert dst[rank][("load-state", key, i)].tobytes() == part.tobytes(), (i, rank)


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


def replace_chunks(src: Path, dst: Path, keys: list[str]) -> None:
    """Write `src`'s chunk files of `keys` over `dst`'s files of the same names (no engine is
    up: nothing reads them meanwhile)."""
    for rel, path in chunk_files(src, keys).items():
        assert (dst / rel).is_file(), rel
        shutil.copyfile(path, dst / rel)


def assert_reloaded(name: str, served: Served, reference: Served, keys: list[str]) -> None:
    """`served` reloaded `keys` from fs and matches the run from scratch `reference`."""
    reused = len(keys) * served.chunk_tokens
    assert served.split["fs"] == reused, served.split
    assert served.cached == reused
    assert served.prompt == reference.prompt
    atol = LOGPROB_ATOL.get(name, 1e-4)
    same = _compared(served, reference, atol if name in NEAR_TIES else 0.0)
    assert served.tokens[:same] == reference.tokens[:same]
    assert np.allclose(served.logprobs[:same], reference.logprobs[:same], rtol=0, atol=atol), (
        served.logprobs, reference.logprobs)


def _compared(served: Served, reference: Served, tie: float) -> int:
    """How many leading greedy tokens (and their logprobs) must agree: all of them, or, with `tie`
    > 0, those before the first position where the runs pick different tokens, if that position is
    a near tie that rounding decides: both runs rank the same two tokens first and second, less
    than `tie` apart, and give each of them logprobs less than `tie` apart (the runs differ after
    it). A parting that is no such tie fails here."""
    for i, (mine, theirs) in enumerate(zip(served.tokens, reference.tokens, strict=True)):
        if mine == theirs:
            continue
        ours, ref = (run.top2[i] if run.top2 else {} for run in (served, reference))
        pair = {str(mine), str(theirs)}
        near = tie > 0 and set(ours) == set(ref) == pair and all(
            abs(top[str(mine)] - top[str(theirs)]) < tie and abs(ours[t] - ref[t]) < tie
            for top in (ours, ref) for t in pair)
        assert near, f"greedy tokens part at {i} without a near tie: {served.tokens} {reference.tokens}"
        return i
    return len(reference.tokens)


def test_greedy_tokens_may_part_only_at_a_near_tie() -> None:
    def run(tokens: list[int], top2: list[dict[str, float]]) -> Served:
        return Served([1], [], 64, tokens, [top[str(t)] for t, top in zip(tokens, top2, strict=True)],
                      0, {}, top2=top2)

    first = {"5": -1.0, "6": -2.0}
    ref = run([5, 7, 8], [first, {"7": -3.000, "9": -3.004}, {"8": -1.0, "2": -4.0}])
    tie = run([5, 9, 3], [first, {"9": -3.001, "7": -3.003}, {"3": -1.0, "2": -4.0}])
    assert _compared(ref, ref, 1e-2) == 3
    assert _compared(tie, ref, 1e-2) == 1
    with pytest.raises(AssertionError, match="part at 1"):
        _compared(tie, ref, 0.0)  # a model whose runs must agree token for token
    wide = run([5, 9, 3], [first, {"9": -2.0, "7": -3.0}, {"3": -1.0, "2": -4.0}])
    with pytest.raises(AssertionError, match="part at 1"):
        _compared(wide, ref, 1e-2)  # 1.0 apart in the reloading run: no tie


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


def assert_same_files(tp1: dict[str, Path], tp2: dict[str, Path], ranges: list[tuple[int, int]]) -> None:
    """The same keys, headers and the row bytes in `ranges` ((offset, length) in the payload)."""
    assert set(tp1) == set(tp2)  # same keys under the same layout fingerprint directory
    head = chunkfmt.HEADER_BYTES
    for rel in tp1:
        one, two = tp1[rel].read_bytes(), tp2[rel].read_bytes()
        assert len(one) == len(two)
        assert one[:_CHECKSUM_AT] == two[:_CHECKSUM_AT]  # magic, version, key, layout, length
        for at, length in ranges:
            assert one[head + at : head + at + length] == two[head + at : head + at + length], (rel, at)


def first_layer_ranges(name: str, block: int, model: Path) -> list[tuple[int, int]]:
    """Where layer 0 lies in a row of one block (float32): K then V of each head, a head's layers
    together (rows are head-major), or the one latent; none for the recurrent hybrids (their
    attention layers follow a recurrent layer)."""
    if name in SECTIONS:
        return []
    if name in LATENT:
        return [(0, block * 576 * 4)]
    heads = 4 if name == "llama" else 2
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    page = 2 * block * 64 * 4
    return [(h * layers * page, page) for h in range(heads)]


@pytest.mark.parametrize("name", sorted(BLOCK))
def test_tp2_reloads_what_tp1_stored_and_the_reverse(name: str, vllm_env: Path, tmp_path: Path) -> None:
    from kvtier.tools.tiny_models import build_tiny_model

    model, options, latent = build_tiny_model(name), llm_options(name), name in LATENT
    workaround = name == "granite-hybrid"
    p, q = PROMPTS["lighthouse"], PROMPTS["bread"]
    if name in SECTIONS:  # three 64-token chunks or more
        p, q = p + " " + q, PROMPTS["library"] + " " + PROMPTS["chess"]

    fs1, out1 = tmp_path / "fs-tp1", tmp_path / "tp1"
    with LocalEngine(model, fs1, options, mamba2_workaround=workaround) as tp1:
        _, ref_q1, stored_p, stored_q = tp1.serve([
            Step(p + TAIL, scratch=True), Step(q + TAIL, scratch=True), Step(p, max_tokens=1),
            Step(q, max_tokens=1)], out1)
    p_keys, q_keys = stored_keys(stored_p), stored_keys(stored_q)
    assert len(p_keys) >= 3 and len(q_keys) >= 3
    assert stored_p.state_rows == (0 if name not in SECTIONS else 2 if name == "qwen3-next" else 1)

    fs2, out2 = tmp_path / "fs-tp2", tmp_path / "tp2"
    copy_chunks(fs1, fs2, with_state(stored_p, p_keys))
    with LocalEngine(model, fs2, options, tp=2, mamba2_workaround=workaround) as tp2:
        ref_p2, reloaded_p, _ = tp2.serve([
            Step(p + TAIL, scratch=True), Step(p + TAIL), Step(q, max_tokens=1)], out2)
    assert_reloaded(name, reloaded_p, ref_p2, p_keys)
    assert_pages_moved(rank_pages(out1, 1), rank_pages(out2, 2), p_keys, latent)
    first = first_layer_ranges(name, BLOCK[name], model)
    assert_same_files(chunk_files(fs1, q_keys), chunk_files(fs2, q_keys), first)
    if name in SECTIONS:
        state_p = with_state(stored_p, p_keys)[len(p_keys) :]
        state_q = with_state(stored_q, q_keys)[len(q_keys) :]
        assert_states_moved(name, rank_pages(out1, 1), rank_pages(out2, 2), state_p[0])
        conv = [(0, CONV_BYTES[name])]
        assert_same_files(chunk_files(fs1, state_q[:1]), chunk_files(fs2, state_q[:1]), conv)
        assert_same_files(chunk_files(fs1, state_q), chunk_files(fs2, state_q), [])

    out3 = tmp_path / "tp1-again"
    replace_chunks(fs2, fs1, with_state(stored_q, q_keys))
    with LocalEngine(model, fs1, options, mamba2_workaround=workaround) as tp1:
        (reloaded_q,) = tp1.serve([Step(q + TAIL)], out3)
    assert_reloaded(name, reloaded_q, ref_q1, q_keys)
    assert_pages_moved(rank_pages(out2, 2), rank_pages(out3, 1), q_keys, latent)
    if name in SECTIONS:
        assert_states_moved(name, rank_pages(out2, 2), rank_pages(out3, 1), state_q[0])
