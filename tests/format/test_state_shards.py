"""Per-rank state segments (`kvtier.format.state_shards`, `StateCopier` with a shard):
the ranks of a TP=2 engine together write exactly the rows a TP=1 engine writes, each byte once,
and each rank reads back its own shard. The expected shards are cut here by hand, the way vLLM cuts
them (a gated-delta-net conv state: q, k and v channels each halved; a Mamba2 conv state: x halved,
the one B and C group whole on every rank; recurrent states by heads), so a wrong order fails."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.format.state_rows import StateLayout, StatePart
from kvtier.format.state_shards import Section, StateShard, merge_spans
from kvtier.transfer.state_copier import StateCopier

ROW = 128
GARBAGE = 0xAB
# gated delta net: conv channels q 4, k 4, v 6 (kernel - 1 = 3, kept transposed by the engine);
# recurrent state 2 heads of [3, 4]
GDN = (
    StateLayout(
        "gdn", (0, 2), (StatePart((14, 3), torch.bfloat16, True), StatePart((2, 3, 4), torch.float32)), ROW
    ),
    ((Section(4), Section(4), Section(6)), (Section(2),)),
)
# Mamba2, one group: conv channels x 8, B 2, C 2; SSM state 4 heads of [2, 2]
MAMBA2 = (
    StateLayout(
        "mamba2", (1,), (StatePart((12, 3), torch.float32), StatePart((4, 2, 2), torch.float32)), ROW
    ),
    ((Section(8), Section(2, True), Section(2, True)), (Section(4),)),
)


def canonical(lay: StateLayout, blocks: int, seed: int) -> list[list[torch.Tensor]]:
    """Whole-model states `[blocks, *canonical shape]` per layer and part."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(blocks, *p.shape, generator=gen).to(p.dtype) for p in lay.parts] for _ in lay.layers]


def by_hand(name: str, part: int, whole: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank` of 2's shard of canonical `whole` ([blocks, rows, ...]), cut as vLLM cuts it."""
    if part == 1:  # heads
        return whole.chunk(2, dim=1)[rank]
    if name == "gdn":
        q, k, v = whole.split([4, 4, 6], dim=1)
        return torch.cat([q.chunk(2, dim=1)[rank], k.chunk(2, dim=1)[rank], v.chunk(2, dim=1)[rank]], dim=1)
    x, b, c = whole.split([8, 2, 2], dim=1)
    return torch.cat([x.chunk(2, dim=1)[rank], b, c], dim=1)


def engine(lay: StateLayout, states: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """The engine's orientation of canonical-orientation states (a transposed conv state)."""
    return [
        [t.transpose(1, 2).contiguous() if p.transposed else t.clone()
         for p, t in zip(lay.parts, parts, strict=True)]
        for parts in states
    ]


def rank_states(
    name: str, lay: StateLayout, whole: list[list[torch.Tensor]], rank: int
) -> list[list[torch.Tensor]]:
    return engine(lay, [[by_hand(name, p, t, rank) for p, t in enumerate(parts)] for parts in whole])


def fresh_rows(lay: StateLayout) -> torch.Tensor:
    return torch.full((lay.rows + 2, ROW), GARBAGE, dtype=torch.uint8)


CASES = {"gdn": GDN, "mamba2": MAMBA2}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_ranks_write_the_rows_tp1_writes_each_byte_once(name: str) -> None:
    lay, sections = CASES[name]
    whole = canonical(lay, 3, seed=1)
    blocks = (2,) * len(lay.layers)
    slots = tuple(range(lay.rows, 0, -1))  # rows out of order: a part straddles them
    tp1 = fresh_rows(lay)
    StateCopier(lay, engine(lay, whole)).engine_to_host(blocks, tp1, slots)
    assert not (tp1[list(slots)] == GARBAGE).all(dim=1).any()

    together = fresh_rows(lay)
    written = []
    for rank in (0, 1):
        copier = StateCopier(lay, rank_states(name, lay, whole, rank), StateShard(sections, 2, rank))
        copier.engine_to_host(blocks, together, slots)
        alone = torch.full_like(together, GARBAGE - 1)
        copier.engine_to_host(blocks, alone, slots)
        written.append(alone != GARBAGE - 1)
    assert torch.equal(together, tp1)
    # every byte of the segment's rows is written by exactly one rank (rows outside it by none)
    assert not (written[0] & written[1]).any()
    assert (written[0] | written[1])[list(slots)].all()
    assert not (written[0] | written[1])[0].any() and not (written[0] | written[1])[-1].any()


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_tp2_rank_loads_its_shard_of_a_tp1_segment(name: str) -> None:
    lay, sections = CASES[name]
    whole = canonical(lay, 3, seed=2)
    slots = tuple(range(lay.rows))
    rows = fresh_rows(lay)
    StateCopier(lay, engine(lay, whole)).engine_to_host((1,) * len(lay.layers), rows, slots)
    for rank in (0, 1):
        dst = rank_states(name, lay, canonical(lay, 3, seed=3), rank)
        copier = StateCopier(lay, dst, StateShard(sections, 2, rank))
        copier.host_to_engine((0,) * len(lay.layers), rows, slots)
        want = rank_states(name, lay, whole, rank)
        for layer in range(len(lay.layers)):
            for part in range(len(lay.parts)):
                assert torch.equal(dst[layer][part][0], want[layer][part][1]), (rank, layer, part)


def test_a_replicated_section_is_written_by_the_first_rank_alone() -> None:
    lay, sections = MAMBA2
    whole = canonical(lay, 1, seed=4)
    slots = tuple(range(lay.rows))
    tp1 = fresh_rows(lay)
    StateCopier(lay, engine(lay, whole)).engine_to_host((0,), tp1, slots)
    rows = fresh_rows(lay)
    for rank in (0, 1):  # rank 1 last: had it written B and C, they would stay
        states = rank_states("mamba2", lay, whole, rank)
        if rank == 1:
            states[0][0][:, 4:] = 99.0  # another B and C on rank 1: never stored
        StateCopier(lay, states, StateShard(sections, 2, rank)).engine_to_host((0,), rows, slots)
    assert torch.equal(rows, tp1)


def test_the_pieces_of_a_rank_in_engine_order() -> None:
    shard = StateShard(MAMBA2[1], 2, 1)
    assert [(p.start, p.end, p.local, p.writes) for p in shard.pieces(0)] == [
        (4, 8, 0, True), (8, 10, 4, False), (10, 12, 6, False)]
    assert shard.local_rows(0) == 8 and shard.canonical_rows(0) == 12
    assert [(p.start, p.end) for p in StateShard(GDN[1], 2, 1).pieces(0)] == [(2, 4), (6, 8), (11, 14)]
    assert merge_spans([(5, 9), (0, 2), (2, 4), (8, 12), (3, 3)]) == [(0, 4), (5, 12)]


def test_bad_shards_are_refused() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 divides"):
        StateShard(GDN[1], 4, 0)
    with pytest.raises(ConfigError, match="rank"):
        StateShard(GDN[1], 2, 2)
    lay, sections = GDN
    with pytest.raises(ValueError, match="state tensor"):  # whole tensors given to a TP=2 rank
        StateCopier(lay, engine(lay, canonical(lay, 1, 0)), StateShard(sections, 2, 0))
    with pytest.raises(ValueError, match="do not cover"):
        StateCopier(lay, engine(lay, canonical(lay, 1, 0)), StateShard(MAMBA2[1], 2, 0))
