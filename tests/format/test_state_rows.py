"""The canonical state-segment format (`kvtier.format.state_rows`): a segment round-trips through host rows
byte for byte, straddling rows; a conv state the engine keeps transposed is stored channels first;
an engine keeping another dtype than the recorded one gets the values converted; state keys are not
chunk keys; bad geometry is refused."""

from __future__ import annotations

import pytest
import torch

from kvtier.format.state_rows import StateLayout, StatePart, state_key, state_keys
from kvtier.transfer.state_copier import StateCopier

ROW = 256


def layout(dtype: torch.dtype = torch.float32) -> StateLayout:
    conv = StatePart((6, 3), torch.bfloat16, transposed=True)
    ssm = StatePart((2, 4, 5), dtype)
    return StateLayout("gdn", (0, 2), (conv, ssm), ROW)


def engine(lay: StateLayout, blocks: int = 4, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(blocks, *p.engine_shape(), generator=gen).to(p.dtype) for p in lay.parts]
        for _ in lay.layers
    ]


def test_geometry_and_description() -> None:
    lay = layout()
    assert lay.layer_bytes == 6 * 3 * 2 + 2 * 4 * 5 * 4
    assert lay.rows == -(-2 * lay.layer_bytes // ROW) == 2
    assert lay.describe() == "gdn@0,2[6x3:bfloat16;2x4x5:float32]"
    assert layout(torch.bfloat16).describe() != lay.describe()


def test_a_segment_round_trips_through_rows_straddling_them() -> None:
    lay = layout()
    src, dst = engine(lay, seed=1), engine(lay, seed=2)
    rows = torch.zeros(5, ROW, dtype=torch.uint8)
    StateCopier(lay, src).engine_to_host((1, 3), rows, (4, 0))
    StateCopier(lay, dst).host_to_engine((2, 0), rows, (4, 0))
    for layer, (s_block, d_block) in enumerate(((1, 2), (3, 0))):
        for part in range(2):
            assert torch.equal(dst[layer][part][d_block], src[layer][part][s_block])
    flat = torch.cat([rows[4], rows[0]])
    conv = flat[: 36].view(torch.bfloat16).view(6, 3)
    assert torch.equal(conv, src[0][0][1].transpose(0, 1))  # channels first in the row
    assert not rows[1:4].any()


def test_an_engine_with_another_dtype_gets_converted_values() -> None:
    stored, wider = layout(torch.bfloat16), layout(torch.float32)
    src = engine(stored)
    dst = [[t.clone() for t in parts] for parts in engine(wider)]
    slots = tuple(range(stored.rows))
    rows = torch.zeros(len(slots), ROW, dtype=torch.uint8)
    StateCopier(stored, src).engine_to_host((0, 0), rows, slots)
    # The engine keeps float32 where bfloat16 was recorded: the copier reads the recorded format.
    copier = StateCopier(stored, [[dst[0][0], dst[0][1]], [dst[1][0], dst[1][1]]])
    copier.host_to_engine((3, 3), rows, slots)
    assert dst[0][1].dtype == torch.float32
    assert torch.equal(dst[0][1][3], src[0][1][0].float())


def test_state_keys_are_not_chunk_keys_and_differ_by_part() -> None:
    key = bytes(range(32))
    keys = state_keys(layout(), key)
    assert len(keys) == 2 and len(set(keys)) == 2 and key not in keys
    assert keys[0] == state_key(key, 0) and all(len(k) == 32 for k in keys)


def test_bad_geometry_is_refused() -> None:
    lay = layout()
    with pytest.raises(ValueError, match="state tensor"):
        StateCopier(lay, [[torch.zeros(4, 6, 3), torch.zeros(4, 2, 4, 5)]] * 2)
    with pytest.raises(ValueError, match="a state segment is 2 rows"):
        StateCopier(lay, engine(lay)).engine_to_host((0, 0), torch.zeros(3, ROW, dtype=torch.uint8), (0,))
