"""Progress of a sweep on the terminal with rich: a bar per point (requests done), a line per event."""

from __future__ import annotations

from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kvtier.bench.multiturn.summary import RequestRecord
from kvtier.bench.multiturn.sweep import Hooks


class RichHooks(Hooks):
    """`sweep.Hooks` drawn with rich; a context manager around the sweep. On `terminal` (the stream
    `engine_log.engine_output` gives, while everything else written to stdout and stderr goes to
    the log), or on stderr (None), where what the engine prints meanwhile shows above the bars."""

    def __init__(self, turns: int, terminal: TextIO | None = None) -> None:
        self.turns = turns
        self.console = Console(file=terminal, stderr=terminal is None)
        captures = terminal is None
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                 console=self.console, redirect_stdout=captures,
                                 redirect_stderr=captures)
        self._task: TaskID | None = None
        self._failed = 0

    def __enter__(self) -> RichHooks:
        self.progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.progress.stop()

    def engine_starting(self, config: str) -> None:
        self.console.log(f"[bold]{config}[/]: starting the engine")

    def point_starting(self, config: str, conversations: int, requests: int) -> None:
        self._failed = 0
        self._task = self.progress.add_task(f"{config:>12} x {conversations:<4}", total=requests,
                                            status="")

    def request_done(self, record: RequestRecord) -> None:
        if self._task is None:
            return
        self._failed += bool(record.error)
        status = f"TTFT {record.ttft_s * 1000:6.0f} ms"
        if self._failed:
            status += f", [red]{self._failed} failed[/]"
        self.progress.update(self._task, advance=1, status=status)

    def point_done(self, point: dict[str, Any]) -> None:
        tokens = " / ".join(f"{k} {v}" for k, v in point["tokens"].items())
        self.console.log(
            f"{point['config']} x {point['conversations']}: {point['prompt_tokens_per_s']:,.0f} prompt "
            f"tok/s, TTFT p99 {point['ttft_s']['p99']:.2f} s, tokens {tokens}"
            + ("" if point.get("tokens_sum_ok", True) else " [red](split != prompt tokens)[/]"))
