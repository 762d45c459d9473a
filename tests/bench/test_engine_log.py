"""`engine_output`: within the block everything a process and its children write (vLLM's logger,
print, warnings, C-level writes to descriptor 2, a child's output) goes to the log, the command's
own lines to the terminal; after it, output is where it was. In a command (descriptors 1 and 2 are
stdout and stderr) and under a test's capture (they are not)."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.bench.engine_log import VLLM_LOGGER, engine_output

COMMAND = """
import logging, os, subprocess, sys, warnings
from pathlib import Path
from kvtier.bench.engine_log import engine_output

vllm = logging.getLogger("vllm")  # as vLLM configures it: its own handler on stdout, no propagation
vllm.addHandler(logging.StreamHandler(sys.stdout))
vllm.setLevel(logging.INFO)
vllm.propagate = False
with engine_output(Path(sys.argv[1])) as terminal:
    print("kvtier: progress", file=terminal, flush=True)
    vllm.info("vllm: engine starting")
    print("printed to stdout")
    print("printed to stderr", file=sys.stderr)
    warnings.warn("a warning")
    os.write(2, b"written to descriptor 2\\n")
    child = "import sys; print('child out'); print('child err', file=sys.stderr)"
    subprocess.run([sys.executable, "-c", child], check=True)
vllm.info("vllm: after the block")
print("the result")
"""
IN_THE_LOG = ("vllm: engine starting", "printed to stdout", "printed to stderr", "a warning",
              "written to descriptor 2", "child out", "child err")


def test_a_command_shows_its_own_lines_and_logs_the_rest(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "vllm.log"
    done = subprocess.run([sys.executable, "-c", COMMAND, str(log)], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stderr == "kvtier: progress\n"
    assert done.stdout == "vllm: after the block\nthe result\n"
    text = log.read_text()
    for line in IN_THE_LOG:
        assert line in text, line
    assert "kvtier: progress" not in text and "the result" not in text
    assert log.stat().st_mode & 0o777 == 0o600


@pytest.fixture
def vllm_handler() -> Iterator[logging.StreamHandler[object]]:
    """A stream handler on vLLM's logger writing to this test's captured stdout."""
    logger = logging.getLogger(VLLM_LOGGER)
    handler: logging.StreamHandler[object] = logging.StreamHandler(sys.stdout)
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_under_a_capture_the_streams_and_vllms_handlers_are_redirected(
    tmp_path: Path, vllm_handler: logging.StreamHandler[object], capsys: pytest.CaptureFixture[str],
) -> None:
    log = tmp_path / "vllm.log"
    captured = vllm_handler.stream
    with engine_output(log) as terminal:
        print("kvtier: progress", file=terminal)
        logging.getLogger(f"{VLLM_LOGGER}.engine").info("vllm: engine starting")
        print("printed to stdout")
        print("printed to stderr", file=sys.stderr)
    assert vllm_handler.stream is captured
    out, err = capsys.readouterr()
    assert (out, err) == ("", "kvtier: progress\n")
    assert log.read_text().splitlines() == ["vllm: engine starting", "printed to stdout",
                                            "printed to stderr"]


def test_verbose_keeps_everything_on_the_terminal_and_the_result_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with engine_output(None) as terminal:
        print("kvtier: progress", file=terminal)
        print("printed to stdout")
    assert capsys.readouterr() == ("", "kvtier: progress\nprinted to stdout\n")
