"""Recurrent-state tensors (gated delta net, Mamba2) and their copiers, for the state copy tests of
the stream path: vLLM's per-block shapes (a conv state kept `[kernel - 1, conv_dim]`), whole or one
TP rank's shard cut here section by section the way vLLM cuts it, in several dtypes."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvtier.format.state_rows import StateLayout, StatePart
from kvtier.format.state_shards import Section, StateShard
from kvtier.transfer.state_copier import StateCopier
from tests.format.helpers import random_kv
from tests.transfer.helpers import NUM_BLOCKS

STATE_LAYERS = (1, 3, 4)
"""Model layer indices of the recurrent layers (attention layers between them)."""

SECTIONS = {
    # gated delta net: conv channels q 16, k 16, v 32 (each sharded); recurrent state 4 heads
    "gdn": ((Section(16), Section(16), Section(32)), (Section(4),)),
    # Mamba2 with one group: conv channels x 32 (sharded), B 8 and C 8 (whole on every rank);
    # SSM state 4 heads
    "mamba2": ((Section(32), Section(8, True), Section(8, True)), (Section(4),)),
}
SSM_SHAPES = {"gdn": (4, 16, 16), "mamba2": (4, 8, 32)}
STATE_KINDS = sorted(SECTIONS)
DTYPES = {
    "bf16+fp32": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float16),
    "fp32+bf16": (torch.float32, torch.bfloat16),
}
"""(conv state dtype, recurrent/SSM state dtype) of the engine, recorded as such."""


@dataclass(frozen=True)
class StateCase:
    """One kind's state layout, one rank's shard of it and that rank's engine state tensors."""

    layout: StateLayout
    shard: StateShard
    tensors: list[list[torch.Tensor]]

    def copier(self, tensors: list[list[torch.Tensor]] | None = None) -> StateCopier:
        return StateCopier(self.layout, self.tensors if tensors is None else tensors, self.shard)

    def blocks(self, seed: int) -> tuple[int, ...]:
        """One block per recurrent layer, as vLLM names them (each layer's own block id)."""
        rng = random.Random(seed)
        return tuple(rng.randrange(NUM_BLOCKS) for _ in self.layout.layers)

    def zeros(self) -> list[list[torch.Tensor]]:
        return [[torch.zeros_like(t) for t in parts] for parts in self.tensors]

    def clone(self) -> list[list[torch.Tensor]]:
        return [[t.clone() for t in parts] for parts in self.tensors]


def state_layout(kind: str, dtypes: str, row_bytes: int) -> StateLayout:
    conv_rows = sum(s.rows for s in SECTIONS[kind][0])
    conv, ssm = DTYPES[dtypes]
    parts = (StatePart((conv_rows, 3), conv, transposed=True), StatePart(SSM_SHAPES[kind], ssm))
    return StateLayout(kind, STATE_LAYERS, parts, row_bytes)


def whole_states(layout: StateLayout, seed: int) -> list[list[torch.Tensor]]:
    """Random whole-model states `[NUM_BLOCKS, *canonical shape]` per layer and part."""
    gen = torch.Generator().manual_seed(seed)
    return [[random_kv((NUM_BLOCKS, *p.shape), p.dtype, gen) for p in layout.parts] for _ in layout.layers]


def cut(whole: torch.Tensor, sections: tuple[Section, ...], tp_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of canonical `whole` (`[blocks, rows, ...]`): each section's share, or
    all of a replicated one, end to end."""
    pieces, start = [], 0
    for s in sections:
        share = s.rows if s.replicated else s.rows // tp_size
        first = start if s.replicated else start + rank * share
        pieces.append(whole[:, first : first + share])
        start += s.rows
    return torch.cat(pieces, dim=1)


def state_case(
    kind: str, row_bytes: int, tp_size: int = 1, rank: int = 0, dtypes: str = "bf16+fp32", seed: int = 0
) -> StateCase:
    """Rank `rank` of `tp_size`'s state tensors of `kind`, in the engine's orientation."""
    layout = state_layout(kind, dtypes, row_bytes)
    shard = StateShard(SECTIONS[kind], tp_size, rank)
    tensors = [
        [
            oriented(part, cut(whole, SECTIONS[kind][i], tp_size, rank))
            for i, (part, whole) in enumerate(zip(layout.parts, parts, strict=True))
        ]
        for parts in whole_states(layout, seed)
    ]
    return StateCase(layout, shard, tensors)


def oriented(part: StatePart, canonical: torch.Tensor) -> torch.Tensor:
    """`[blocks, *canonical shape]` states as the engine keeps them (a conv state transposed)."""
    return (canonical.transpose(1, 2) if part.transposed else canonical).contiguous()
