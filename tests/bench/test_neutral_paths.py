"""What a results file records of a path names no machine: home as `~`, the working and temp
directories' paths relative, every other path and word kept."""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

import pytest

from kvtier.bench.neutral_paths import neutral_argv, neutral_path


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A home, a working tree under it and a temp directory, all under pytest's own temp dir."""
    home = tmp_path / "home" / "someone"
    tree = home / "src" / "kvtier"
    temp = tmp_path / "scratch"
    for d in (tree, temp):
        d.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tree)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return {"home": home, "tree": tree, "temp": temp}


def test_home_becomes_tilde(machine: dict[str, Path]) -> None:
    model = machine["home"] / ".cache" / "kvtier" / "models" / "SmolLM2-135M-Instruct"
    assert neutral_path(str(model)) == "~/.cache/kvtier/models/SmolLM2-135M-Instruct"
    assert neutral_path(str(machine["home"])) == "~"


def test_working_tree_wins_over_home_and_is_relative(machine: dict[str, Path]) -> None:
    assert neutral_path(str(machine["tree"] / "bench-results" / "run")) == "bench-results/run"
    assert neutral_path(str(machine["tree"])) == "."


def test_temp_directories_become_relative_names(machine: dict[str, Path]) -> None:
    assert neutral_path(str(machine["temp"] / "kvtier-chaos-x1y2" / "fs-mnt" / "fs")) == \
        "kvtier-chaos-x1y2/fs-mnt/fs"
    assert neutral_path("/tmp/i27b/mt_fs") == "i27b/mt_fs"


def test_a_command_line_is_rewritten_wherever_a_path_starts(machine: dict[str, Path]) -> None:
    model = machine["home"] / ".cache" / "m"
    argv = ["kvtier", "bench", "multiturn", "--model", str(model), "--out=/tmp/run", "--json"]
    assert neutral_path(shlex.join(argv)) == "kvtier bench multiturn --model ~/.cache/m --out=run --json"
    assert neutral_argv(argv) == ["kvtier", "bench", "multiturn", "--model", "~/.cache/m",
                                  "--out=run", "--json"]


def test_generic_paths_and_look_alikes_are_kept(machine: dict[str, Path]) -> None:
    for text in ("/dev/shm/kvtier-1", "/var/tmp/kvtier-bench-123", "/mnt/kv", "/tmpfs/x",
                 "a/tmp/b", "prompt tokens/s"):
        assert neutral_path(text) == text
    assert "~" not in neutral_path(f"{machine['home']}-other/x")
