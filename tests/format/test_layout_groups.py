"""Copy plans over layers in several block-id groups (hybrid models): each layer's page lands at its
model layer's offset whatever its group, a load skips `SKIP_BLOCK`, a store refuses it, and the
layer kinds are in the layout fingerprint."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.format.layout import SKIP_BLOCK, CanonicalLayout, TPShard, host_rows
from kvtier.integrations.vllm.model.backend_layouts import VllmCpuLayout
from kvtier.transfer.copy_plan import CopyPlan

BLOCK, HEADS, DIM = 8, 2, 4
KINDS = ("sliding_window:16", "attention", "sliding_window:16")


def make(layer_groups: tuple[int, ...]) -> tuple[CanonicalLayout, CopyPlan, torch.Tensor]:
    layout = CanonicalLayout(3, HEADS, DIM, BLOCK, torch.float32, layer_kinds=KINDS)
    plan = CopyPlan(layout, VllmCpuLayout(), TPShard(HEADS), BLOCK, layer_groups)
    rows = host_rows(memoryview(bytearray(4 * layout.row_bytes)), layout.row_bytes, 4)
    return layout, plan, rows


def test_each_layer_uses_its_groups_blocks_and_lands_at_its_model_offset() -> None:
    gen = torch.Generator().manual_seed(0)
    layout, plan, rows = make((1, 0, 1))
    src = [torch.randn(10, HEADS, BLOCK, 2 * DIM, generator=gen) for _ in range(3)]
    # chunk 0: group 0 (layer 1) in block 4, group 1 (layers 0 and 2) in block 7
    plan.engine_to_host(src, [(4, 7)], rows, [2])
    single = CopyPlan(layout, VllmCpuLayout(), TPShard(HEADS), BLOCK)
    expected = host_rows(memoryview(bytearray(4 * layout.row_bytes)), layout.row_bytes, 4)
    for layer, block in ((0, 7), (1, 4), (2, 7)):
        one = [src[layer] if i == layer else torch.zeros_like(src[layer]) for i in range(3)]
        part = host_rows(memoryview(bytearray(4 * layout.row_bytes)), layout.row_bytes, 4)
        single.engine_to_host(one, [(block,)], part, [2])
        page = layout.page_view(part, layer)
        layout.page_view(expected, layer).copy_(page)
    assert torch.equal(rows, expected)

    dst = [torch.zeros_like(t) for t in src]
    plan.host_to_engine(dst, [(5, SKIP_BLOCK)], rows, [2])
    assert torch.equal(dst[1][5], src[1][4])  # group 0's layer was loaded
    assert not dst[0].any() and not dst[2].any()  # group 1 holds no block there: untouched


def test_a_store_refuses_a_skipped_block_and_groups_must_be_whole() -> None:
    _, plan, rows = make((0, 1, 0))
    src = [torch.zeros(4, HEADS, BLOCK, 2 * DIM) for _ in range(3)]
    with pytest.raises(ValueError, match="every block"):
        plan.engine_to_host(src, [(1, SKIP_BLOCK)], rows, [0])
    with pytest.raises(ValueError, match="2 block ids"):
        plan.host_to_engine(src, [(1,)], rows, [0])
    layout = plan.layout
    with pytest.raises(ConfigError, match="layer_groups"):
        CopyPlan(layout, VllmCpuLayout(), TPShard(HEADS), BLOCK, (0, 2, 0))


def test_layer_kinds_change_the_fingerprint_only_when_some_layer_is_not_full_attention() -> None:
    plain = CanonicalLayout(3, HEADS, DIM, BLOCK, torch.float32)
    full = CanonicalLayout(3, HEADS, DIM, BLOCK, torch.float32, layer_kinds=("attention",) * 3)
    hybrid = CanonicalLayout(3, HEADS, DIM, BLOCK, torch.float32, layer_kinds=KINDS)
    other = CanonicalLayout(3, HEADS, DIM, BLOCK, torch.float32, layer_kinds=KINDS[::-1][1:] + KINDS[:1])
    assert plain.fingerprint == full.fingerprint
    assert len({plain.fingerprint, hybrid.fingerprint, other.fingerprint}) == 3
    with pytest.raises(ConfigError, match="layer_kinds"):
        CanonicalLayout(3, HEADS, DIM, BLOCK, torch.float32, layer_kinds=KINDS[:2])


def test_an_mla_latent_page_is_one_row_per_token_written_once_whatever_the_tp_degree() -> None:
    from kvtier.integrations.vllm.model.backend_layouts import VllmMlaLayout, engine_layout_name

    dim, block = 12, 4
    layout = CanonicalLayout(
        2, 1, dim, 2 * block, torch.float32, layer_kinds=("mla_latent:12",) * 2, latent=True
    )
    assert layout.page_bytes == 2 * block * dim * 4
    gen = torch.Generator().manual_seed(1)
    src = [torch.randn(6, 1, block, dim, generator=gen) for _ in range(2)]
    chunk = (5, 2)
    rows = {}
    for tp in (1, 2):
        for rank in range(tp):
            plan = CopyPlan(layout, VllmMlaLayout(), TPShard(1, tp, rank), block)
            buf = host_rows(memoryview(bytearray(layout.row_bytes)), layout.row_bytes, 1)
            plan.engine_to_host(src, [chunk], buf, [0])
            rows[(tp, rank)] = buf
    assert not rows[(2, 1)].any()  # a replica writes nothing
    assert torch.equal(rows[(1, 0)], rows[(2, 0)])
    page = layout.page_view(rows[(1, 0)], 1)  # [slots, 1 part, 1 head, tokens, dim]
    assert torch.equal(page[0, 0, 0], torch.cat([src[1][5, 0], src[1][2, 0]]))
    dst = [torch.zeros(6, block, dim) for _ in range(2)]  # 3-D, as MLACommonBackend's shape
    CopyPlan(layout, VllmMlaLayout(), TPShard(1, 2, 1), block).host_to_engine(
        dst, [(0, 3)], rows[(1, 0)], [0]
    )
    assert torch.equal(dst[0][3], src[0][2, 0]) and torch.equal(dst[0][0], src[0][5, 0])
    assert engine_layout_name("cpu", (6, 1, block, dim), latent=True) == "vllm_mla"
    plain = CanonicalLayout(2, 1, dim, 2 * block, torch.float32)
    assert plain.fingerprint != CanonicalLayout(2, 1, dim, 2 * block, torch.float32, latent=True).fingerprint
