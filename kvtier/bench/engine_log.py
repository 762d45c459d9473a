"""Where an engine's output goes while a command runs it: a log file, so that the terminal shows the
command's own progress lines and result only.

vLLM logs through its logger "vllm", which has a handler of its own (a stream, stdout unless
`VLLM_LOGGING_STREAM` says otherwise, taken when vLLM is imported) and does not propagate; torch,
transformers and tqdm write warnings and progress bars to stderr, some of them from C++ straight to
file descriptor 2; child processes (kvtier's tier processes, vLLM's helpers) inherit descriptors 1
and 2. Within `engine_output(log_path)`:

- descriptors 1 and 2 point at `log_path` (opened for appending, private to the user): so do
  `sys.stdout` and `sys.stderr` when they write to those descriptors, and every handler that
  holds them, whenever it was made;
- when `sys.stdout` or `sys.stderr` is another object (a test's capture), it is replaced by the
  file for the block, and so is the stream of each handler of the "vllm" logger;
- the block gets the terminal: a stream on what stderr was when it began, for the command's own
  lines (rich's progress included).

A server's output goes to the same file by another way: `VLLMServer` opens `log_path` for its
process group. With `log_path` None (`--verbose`) nothing is redirected but stdout, which goes to
stderr: a command prints its result on stdout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

VLLM_LOGGER = "vllm"
LOG_NAME = "vllm.log"
"""The log's name in a benchmark's results directory."""


def default_log(prefix: str) -> Path:
    """A new private file for one command's log in the system's temp directory."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=tempfile.gettempdir())
    os.close(fd)
    return Path(name)


def open_log(log_path: Path) -> int:
    """`log_path` opened for appending (created 0600 when missing); a descriptor the caller closes."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


@contextlib.contextmanager
def _descriptors_to(fd: int) -> Iterator[None]:
    """Descriptors 1 and 2 point at `fd` within the block, and back where they were after it."""
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:  # buffered text belongs to the log, not to the terminal
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
        for target, old in zip((1, 2), saved, strict=True):
            os.dup2(old, target)
            os.close(old)


@contextlib.contextmanager
def _vllm_handlers_to(log: TextIO) -> Iterator[None]:
    """The stream handlers of vLLM's logger write to `log` within the block; after it, each gets
    back its stream, and one vLLM made within the block (its stream: `log`) gets stdout."""
    logger = logging.getLogger(VLLM_LOGGER)
    saved = {h: h.setStream(log) for h in logger.handlers if type(h) is logging.StreamHandler}
    try:
        yield
    finally:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is log:
                handler.setStream(saved.get(handler) or sys.stdout)


def _terminal() -> tuple[TextIO, bool]:
    """A stream on stderr that outlives a redirection of descriptor 2 (a new descriptor, which the
    caller closes: the flag), or stderr itself when it has no descriptor."""
    fd = _fileno(sys.stderr)
    if fd is None:
        return sys.stderr, False
    stream = open(os.dup(fd), "w", buffering=1, encoding=sys.stderr.encoding or "utf-8",  # noqa: SIM115
                  errors="replace")
    return stream, True


@contextlib.contextmanager
def engine_output(log_path: Path | None) -> Iterator[TextIO]:
    """Within the block, the output of this process and of the processes it starts goes to
    `log_path` (see the module docstring); the block gets a stream on the terminal. With None,
    stdout goes to stderr and the block gets stderr. Enter it on the main thread, before the
    engine starts; leave it after the engine stopped."""
    if log_path is None:
        with contextlib.redirect_stdout(sys.stderr):
            yield sys.stderr
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    terminal, owned = _terminal()
    fd = open_log(log_path)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_descriptors_to(fd))
            if _fileno(sys.stdout) != 1 or _fileno(sys.stderr) != 2:
                log = stack.enter_context(open(os.dup(fd), "a", buffering=1, encoding="utf-8",
                                               errors="replace"))
                stack.enter_context(_vllm_handlers_to(log))
                stack.enter_context(contextlib.redirect_stdout(log))
                stack.enter_context(contextlib.redirect_stderr(log))
            yield terminal
    finally:
        os.close(fd)
        if owned:
            terminal.close()
