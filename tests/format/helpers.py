"""Random KV tensors and canonical host rows for the layout and copy tests."""

from __future__ import annotations

import torch

from kvtier.format.layout import CanonicalLayout, host_rows


def random_kv(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of `dtype` (NaNs included: compare with `same`)."""
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def make_rows(layout: CanonicalLayout, num_slots: int) -> tuple[bytearray, torch.Tensor]:
    buf = bytearray(num_slots * layout.row_bytes)
    return buf, host_rows(memoryview(buf), layout.row_bytes, num_slots)
