"""The stored KV dtype (`kv_dtype.stored_kv_dtype`): unquantized caches keep their dtype, fp8 ones
are named by their fp8 format, others are refused naming the key and the value; the format reaches
the chunk keys and the layout fingerprint, so two formats never share a chunk; fp8 pages cross the
staged copy path as bytes, never converted."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.format.keys import ChunkHasher, ModelFingerprint
from kvtier.format.layout import CanonicalLayout, TPShard
from kvtier.integrations.vllm.model.backend_layouts import engine_layout
from kvtier.integrations.vllm.model.kv_dtype import holds, stored_kv_dtype
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.staged import StagedCopy


def test_unquantized_caches_keep_their_dtype_and_fp8_is_named_by_format() -> None:
    assert stored_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert stored_kv_dtype("float32", torch.float32) == torch.float32
    assert stored_kv_dtype("fp8", torch.uint8) == torch.float8_e4m3fn
    assert stored_kv_dtype("fp8_e4m3", torch.uint8) == torch.float8_e4m3fn
    assert stored_kv_dtype("fp8_e5m2", torch.uint8) == torch.float8_e5m2


@pytest.mark.parametrize("value", ["nvfp4", "int8_per_token_head", "fp8_ds_mla", "turboquant_k8v4"])
def test_other_quantized_caches_are_refused_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype") as raised:
        stored_kv_dtype(value, torch.uint8)
    assert value in str(raised.value) and "fp8_e5m2" in str(raised.value)


def test_skipped_layers_with_fp8_are_refused() -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype_skip_layers"):
        stored_kv_dtype("fp8", torch.uint8, ["model.layers.0.self_attn.attn"])
    assert stored_kv_dtype("auto", torch.float16, ["model.layers.0.self_attn.attn"]) == torch.float16


def test_vllm_uint8_tensors_hold_fp8_only() -> None:
    assert holds(torch.uint8, torch.float8_e4m3fn) and holds(torch.uint8, torch.float8_e5m2)
    assert holds(torch.float32, torch.float32)
    assert not holds(torch.uint8, torch.float32) and not holds(torch.float16, torch.bfloat16)


def _layout(dtype: torch.dtype) -> CanonicalLayout:
    return CanonicalLayout(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4, dtype=dtype)


def test_each_format_has_its_own_keys_and_layout_fingerprint() -> None:
    formats = [torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
    fingerprints = [
        ModelFingerprint("m", "", "torch.float32", str(d), num_layers=2, num_kv_heads=2, head_dim=8)
        for d in formats
    ]
    keys = {ChunkHasher("sha256", fp, 4).keys(list(range(8)))[0] for fp in fingerprints}
    assert len(keys) == len(formats)
    assert len({_layout(d).fingerprint for d in formats}) == len(formats)
    assert _layout(torch.float8_e5m2).page_bytes * 4 == _layout(torch.float32).page_bytes


def test_fp8_pages_cross_the_staged_copy_as_bytes() -> None:
    """Every byte value, NaN and infinity patterns of both formats included, goes device -> host
    row -> device unchanged, and the row holds what the plain plan writes."""
    layout = _layout(torch.float8_e4m3fn)
    plan = CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(2, 1, 0), block_size=4)
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randint(0, 256, (6, 2, 4, 16), dtype=torch.uint8, generator=gen) for _ in range(2)]
    kv[0].view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    staged = StagedCopy(plan, kv)
    rows, expected = (torch.zeros(3, layout.row_bytes, dtype=torch.uint8) for _ in range(2))
    staged.store(rows, [[1], [4]], [0, 2])()
    plan.engine_to_host(kv, [[1], [4]], expected, [0, 2])
    assert torch.equal(rows, expected)
    back = [torch.zeros_like(t) for t in kv]
    StagedCopy(plan, back).load(rows, [[3], [5]], [0, 2])
    for src, dst in zip(kv, back, strict=True):
        assert torch.equal(dst[3], src[1]) and torch.equal(dst[5], src[4])
