"""Which rows of a canonical recurrent state (`kvtier.format.state_rows`) one tensor-parallel rank holds.

An engine shards each state tensor of a recurrent layer along its first canonical axis: the conv
state's channels, the recurrent/SSM state's heads. That axis is a concatenation of sections (a
gated-delta-net conv state: its q, k and v channels; a Mamba2 conv state: x, B and C; a recurrent
state: one section, its heads). Rank r of tp holds, section by section and in that order, rows
`[r * n / tp, (r + 1) * n / tp)` of a section of n rows, or all of it when the section is
replicated (vLLM gives every rank the whole of Mamba2's B and C groups when tp does not divide
their number); its engine tensor is those pieces end to end.

Stores: each rank writes the canonical bytes of the pieces it holds, and only the first rank a
replicated section and the segment's zero padding, so TP ranks together write exactly the bytes a
TP=1 engine writes, each byte once, and never the same byte twice (ranks write into the same host
rows at once). Loads: each rank reads every piece it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class Section:
    """`rows` consecutive canonical rows along a state part's first axis, sharded evenly over the TP
    ranks or, `replicated`, held whole by every rank."""

    rows: int
    replicated: bool = False


@dataclass(frozen=True)
class Piece:
    """Canonical rows `[start, end)` of a state part, at row `local` of the rank's engine tensor;
    `writes`: this rank stores them."""

    start: int
    end: int
    local: int
    writes: bool


@dataclass(frozen=True)
class StateShard:
    """The canonical rows of each state part (`sections[p]`, in part order) that TP rank `rank` of
    `tp_size` holds."""

    sections: tuple[tuple[Section, ...], ...]
    tp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size <= 0 or not 0 <= self.rank < self.tp_size:
            raise ConfigError("tp", (self.tp_size, self.rank), "tp_size > 0 and 0 <= rank < tp_size")
        for p, sections in enumerate(self.sections):
            for s in sections:
                if s.rows <= 0 or (not s.replicated and s.rows % self.tp_size):
                    raise ConfigError(
                        f"states.sections[{p}]", s.rows,
                        f"a positive number of rows that tensor_parallel_size={self.tp_size} divides",
                    )

    @classmethod
    def whole(cls, rows: Sequence[int]) -> StateShard:
        """One rank holding parts of `rows[p]` canonical rows each, whole (TP=1)."""
        return cls(tuple((Section(n),) for n in rows))

    def pieces(self, part: int) -> tuple[Piece, ...]:
        """Part `part`'s pieces this rank holds, in its engine tensor's order."""
        out = []
        start = local = 0
        for s in self.sections[part]:
            if s.replicated:
                begin, size, writes = start, s.rows, self.rank == 0
            else:
                size = s.rows // self.tp_size
                begin, writes = start + self.rank * size, True
            out.append(Piece(begin, begin + size, local, writes))
            start += s.rows
            local += size
        return tuple(out)

    def canonical_rows(self, part: int) -> int:
        """Rows of part `part` in the canonical (whole-model) tensor."""
        return sum(s.rows for s in self.sections[part])

    def local_rows(self, part: int) -> int:
        """Rows of part `part` in this rank's engine tensor."""
        return sum(p.end - p.start for p in self.pieces(part))

    @property
    def writes_padding(self) -> bool:
        """Whether this rank writes a segment's zero padding (the first rank)."""
        return self.rank == 0


def merge_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte spans `[a, b)` sorted, with touching or overlapping ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out
