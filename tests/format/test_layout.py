"""Canonical layout and copy plans: round trips, TP independence, a per-element reference."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.format.layout import ROW_ALIGN, CanonicalLayout, TPShard, host_rows
from kvtier.integrations.vllm.model.backend_layouts import (
    ENGINE_LAYOUTS,
    StackedKVLayout,
    VllmCpuLayout,
    VllmFlashAttnLayout,
    engine_layout,
)
from kvtier.transfer.copy_plan import CopyPlan, EngineLayout
from tests.format.helpers import make_rows, random_kv, same

BLOCK = 8
HEAD_DIM = 4
KV_LAYOUTS = sorted(name for name, cls in ENGINE_LAYOUTS.items() if not cls.latent)  # K and V


def to_engine(layout: EngineLayout, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Build an engine tensor from logical K, V `[num_blocks, H, block_size, D]`, written with
    the backend's own description of its memory (independent of `EngineLayout.blocks`)."""
    b, h, n, d = k.shape
    if isinstance(layout, VllmCpuLayout):
        kt = k.transpose(2, 3).reshape(b, h, n * d)
        return torch.stack([kt, v.reshape(b, h, n * d)], dim=2).reshape(b, h, n, 2 * d)
    if isinstance(layout, VllmFlashAttnLayout):
        return torch.cat([k, v], dim=-1)
    return torch.stack([k, v]).permute(0, 1, 3, 2, 4).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("name", KV_LAYOUTS)
def test_round_trip_is_identity(dtype: torch.dtype, blocks_per_chunk: int, name: str) -> None:
    gen = torch.Generator().manual_seed(blocks_per_chunk)
    rng = random.Random(7)
    layout = CanonicalLayout(3, 2, HEAD_DIM, BLOCK * blocks_per_chunk, dtype)
    plan = CopyPlan(layout, engine_layout(name), TPShard(2), BLOCK)
    num_blocks, n_chunks, num_slots = 24, 5, 9
    shape: tuple[int, ...] = (num_blocks, 2, BLOCK, 2 * HEAD_DIM)
    if name == StackedKVLayout.name:
        shape = (2, num_blocks, BLOCK, 2, HEAD_DIM)
    src = [random_kv(shape, dtype, gen) for _ in range(layout.num_layers)]
    picked = rng.sample(range(num_blocks), n_chunks * blocks_per_chunk)
    blocks = [picked[i * blocks_per_chunk : (i + 1) * blocks_per_chunk] for i in range(n_chunks)]
    slots = rng.sample(range(num_slots), n_chunks)
    _, rows = make_rows(layout, num_slots)
    plan.engine_to_host(src, blocks, rows, slots)

    dst = [torch.zeros_like(t) for t in src]
    plan.host_to_engine(dst, blocks, rows, slots)
    for a, b in zip(src, dst, strict=True):
        untouched = [i for i in range(num_blocks) if i not in picked]
        for ea, eb in zip(plan.engine.kv_views(a, HEAD_DIM), plan.engine.kv_views(b, HEAD_DIM), strict=True):
            assert same(ea[picked], eb[picked])
            assert not eb[untouched].contiguous().view(torch.uint8).any()


def test_canonical_row_matches_per_element_reference() -> None:
    """vLLM CPU memory model: per block and head, K transposed [D, block_size], then V; the row
    head-major: per head, per layer, K then V, each [chunk_tokens, head_dim]."""
    gen = torch.Generator().manual_seed(0)
    layers, heads, bpc = 2, 3, 2
    layout = CanonicalLayout(layers, heads, HEAD_DIM, BLOCK * bpc, torch.float32)
    plan = CopyPlan(layout, VllmCpuLayout(), TPShard(heads), BLOCK)
    kvs = [torch.randn(6, heads, BLOCK, 2 * HEAD_DIM, generator=gen) for _ in range(layers)]
    chunk_blocks, slot = [4, 1], 2
    _, rows = make_rows(layout, 3)
    plan.engine_to_host(kvs, [chunk_blocks], rows, [slot])

    tokens = layout.chunk_tokens
    ref = torch.zeros(layout.row_bytes // 4)
    for layer, kv in enumerate(kvs):
        flat = kv.reshape(-1).tolist()
        for kind in range(2):
            for h in range(heads):
                for t in range(tokens):
                    block, tt = chunk_blocks[t // BLOCK], t % BLOCK
                    for d in range(HEAD_DIM):
                        src = (block * heads + h) * BLOCK * 2 * HEAD_DIM
                        if kind == 0:
                            src += d * BLOCK + tt
                        else:
                            src += BLOCK * HEAD_DIM + tt * HEAD_DIM + d
                        dst = (((h * layers + layer) * 2 + kind) * tokens + t) * HEAD_DIM + d
                        ref[dst] = flat[src]
    assert same(rows[slot], ref.view(torch.uint8))
    assert not rows[[0, 1]].any()


@pytest.mark.parametrize("name", KV_LAYOUTS)
@pytest.mark.parametrize("heads, tp_sizes", [(4, [1, 2, 4]), (2, [1, 2, 4, 8])])
def test_tp_shards_and_backends_write_identical_rows(name: str, heads: int, tp_sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(heads)
    bpc, num_blocks, dtype = 2, 10, torch.bfloat16
    layout = CanonicalLayout(2, heads, HEAD_DIM, BLOCK * bpc, dtype)
    logical = [
        (
            random_kv((num_blocks, heads, BLOCK, HEAD_DIM), dtype, gen),
            random_kv((num_blocks, heads, BLOCK, HEAD_DIM), dtype, gen),
        )
        for _ in range(layout.num_layers)
    ]
    blocks, slots = [[3, 7], [0, 9], [5, 2]], [4, 0, 2]
    reference = None
    for tp in tp_sizes:
        _, rows = make_rows(layout, 5)
        for rank in range(tp):
            shard = TPShard(heads, tp, rank)
            h0, h1 = shard.head_start, shard.head_end
            engine = engine_layout(name)
            tensors = [to_engine(engine, k[:, h0:h1], v[:, h0:h1]) for k, v in logical]
            if not shard.writes:
                tensors = [t.fill_(1) for t in tensors]
            CopyPlan(layout, engine, shard, BLOCK).engine_to_host(tensors, blocks, rows, slots)
        if reference is None:
            reference = rows.clone()
        assert torch.equal(rows, reference), f"TP={tp} differs from TP=1"

        for rank in range(tp):
            shard = TPShard(heads, tp, rank)
            h0, h1 = shard.head_start, shard.head_end
            engine = engine_layout(name)
            loaded = [torch.zeros_like(to_engine(engine, k[:, h0:h1], v[:, h0:h1])) for k, v in logical]
            CopyPlan(layout, engine, shard, BLOCK).host_to_engine(loaded, blocks, rows, slots)
            ids = [b for chunk in blocks for b in chunk]
            for (k, v), t in zip(logical, loaded, strict=True):
                got_k, got_v = engine.kv_views(t, HEAD_DIM)
                assert same(got_k[ids], k[ids, h0:h1]) and same(got_v[ids], v[ids, h0:h1])


def test_tp_shard_heads_follow_vllm() -> None:
    assert [(s.head_start, s.head_end) for s in (TPShard(4, 2, r) for r in range(2))] == [
        (0, 2),
        (2, 4),
    ]
    replicated = [TPShard(2, 4, r) for r in range(4)]
    assert [s.head_start for s in replicated] == [0, 0, 1, 1]
    assert [s.writes for s in replicated] == [True, False, True, False]
    with pytest.raises(ConfigError, match="tp_size"):
        TPShard(4, 3, 0)
    with pytest.raises(ConfigError, match="tp_size"):
        TPShard(4, 6, 0)
    with pytest.raises(ConfigError):
        TPShard(4, 2, 2)


def test_geometry_and_fingerprint() -> None:
    base = CanonicalLayout(30, 3, 64, 128, torch.bfloat16)
    assert base.page_bytes == 2 * 3 * 128 * 64 * 2
    assert base.row_bytes % ROW_ALIGN == 0 and base.row_bytes >= 30 * base.page_bytes
    block = 128 * 64 * 2
    assert base.head_bytes == 30 * 2 * block  # rows are head-major: one head, every layer
    assert base.part_offset(2, 29, 1) == 2 * base.head_bytes + (29 * 2 + 1) * block
    assert base.fingerprint == "82a90280dc3e1424f6266d59e3b2a90a"
    assert base.fingerprint == CanonicalLayout(30, 3, 64, 128, torch.bfloat16).fingerprint
    changes = {
        "num_layers": 31,
        "num_kv_heads": 4,
        "head_dim": 128,
        "chunk_tokens": 256,
        "dtype": torch.float16,
    }
    prints = {dataclasses.replace(base, **{k: v}).fingerprint for k, v in changes.items()}  # type: ignore[arg-type]
    assert len(prints) == len(changes) and base.fingerprint not in prints
    for tp in (1, 3):
        assert CopyPlan(base, VllmCpuLayout(), TPShard(3, tp, 0), 64).layout.fingerprint == (base.fingerprint)
    odd = CanonicalLayout(1, 1, 3, 5, torch.float32)
    assert odd.row_bytes == ROW_ALIGN and odd.page_bytes == 120


def test_host_rows_share_memory() -> None:
    layout = CanonicalLayout(1, 1, 4, 8, torch.float16)
    buf, rows = make_rows(layout, 2)
    rows[1, 0] = 7
    assert buf[layout.row_bytes] == 7
    with pytest.raises(ValueError, match="do not fit"):
        host_rows(memoryview(buf), layout.row_bytes, 3)


def test_invalid_inputs_raise_clear_errors() -> None:
    layout = CanonicalLayout(1, 2, HEAD_DIM, 2 * BLOCK, torch.float16)
    plan = CopyPlan(layout, VllmCpuLayout(), TPShard(2), BLOCK)
    kv = [torch.zeros(4, 2, BLOCK, 2 * HEAD_DIM, dtype=torch.float16)]
    _, rows = make_rows(layout, 3)
    with pytest.raises(ValueError, match="block ids"):
        plan.engine_to_host(kv, [[0]], rows, [0])
    with pytest.raises(ValueError, match=r"lie in \[0, 4\)"):
        plan.engine_to_host(kv, [[0, 4]], rows, [0])
    with pytest.raises(ValueError, match="slots"):
        plan.engine_to_host(kv, [[0, 1]], rows, [3])
    with pytest.raises(ValueError, match="distinct"):
        plan.engine_to_host(kv, [[0, 1], [2, 3]], rows, [1, 1])
    with pytest.raises(ValueError, match="distinct"):
        plan.host_to_engine(kv, [[0, 1], [1, 2]], rows, [0, 1])
    with pytest.raises(ValueError, match="layer tensors"):
        plan.engine_to_host(kv * 2, [[0, 1]], rows, [0])
    with pytest.raises(ValueError, match="expected"):
        plan.engine_to_host([torch.zeros(4, 3, BLOCK, 2 * HEAD_DIM)], [[0, 1]], rows, [0])
    with pytest.raises(ValueError, match="host rows"):
        plan.engine_to_host(kv, [[0, 1]], rows[:, :-1], [0])
    with pytest.raises(ConfigError, match="block_size"):
        CopyPlan(layout, VllmCpuLayout(), TPShard(2), 3)
    with pytest.raises(ConfigError, match="vllm_cpu"):
        engine_layout("vllm-cpu")
    with pytest.raises(ConfigError, match="head_dim"):
        CanonicalLayout(1, 1, 0, 8, torch.float16)


@pytest.mark.parametrize("isa, block_size", [("vec", 32), ("vec16", 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_cpu_kernel_writes_what_vllm_cpu_layout_reads(
    isa: str, block_size: int, dtype: torch.dtype
) -> None:
    """Keys and values stored by vLLM's own CPU kernel land in canonical rows where expected."""
    ops = pytest.importorskip("vllm._custom_ops")
    gen = torch.Generator().manual_seed(1)
    heads, head_dim, num_blocks = 2, 64, 4
    kv = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv.view(num_blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    n = num_blocks * block_size
    key = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    slot_mapping = torch.randperm(n, generator=gen)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)

    layout = CanonicalLayout(1, heads, head_dim, 2 * block_size, dtype)
    plan = CopyPlan(layout, VllmCpuLayout(), TPShard(heads), block_size)
    _, rows = make_rows(layout, 1)
    plan.engine_to_host([kv], [[3, 1]], rows, [0])
    page = layout.page_view(rows, 0)[0]
    for j, block in enumerate([3, 1]):
        positions = slot_mapping.argsort()[block * block_size : (block + 1) * block_size]
        tokens = slice(j * block_size, (j + 1) * block_size)
        assert torch.equal(page[0, :, tokens], key[positions].transpose(0, 1))
        assert torch.equal(page[1, :, tokens], value[positions].transpose(0, 1))
