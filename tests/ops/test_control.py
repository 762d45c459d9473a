"""The control socket over a real Unix socket: owner-only permissions, replies, switches applied
by the owning thread, and `kvtier ctl`'s discovery of the engine."""

from __future__ import annotations

import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.ops.control_server import (
    ControlServer,
    default_control_dir,
    engine_control_dir,
    private_dir,
    request,
)
from kvtier.ops.metrics import KVTierMetrics


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ControlServer]:
    metrics = KVTierMetrics()
    metrics.set("used_chunks", 3, "fs")
    metrics.set("used_bytes", 300, "fs")
    metrics.set("capacity_bytes", 1000, "fs")
    metrics.set("used_fraction", 0.3, "fs")
    metrics.set("tier_enabled", 1, "fs")
    metrics.set("tier_up", 1, "fs")
    metrics.set("tier_restarts", 2, "fs")
    metrics.set("tier_last_failure", 1_700_000_000, "fs", "hung")
    metrics.set("tier_last_failure", 1_700_000_100, "fs", "exited")  # the latest
    s = ControlServer(tmp_path / "ctl", ["fs"], metrics, lambda: {"rollbacks": 0}, apply_wait_s=0.3)
    yield s
    s.close()


def test_socket_and_directory_are_owner_only(server: ControlServer, tmp_path: Path) -> None:
    assert stat.S_IMODE(server.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(server.path.parent.stat().st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(ConfigError, match="control_dir"):
        private_dir(open_dir)


def test_list_guard_and_errors(server: ControlServer) -> None:
    tiers = request(server.path, {"cmd": "list"})["tiers"]
    assert [t["tier"] for t in tiers] == ["host", "fs"]
    assert tiers[1] == {"tier": "fs", "enabled": True, "used_bytes": 300, "used_chunks": 3,
                        "capacity_bytes": 1000, "used_fraction": 0.3, "up": True, "restarts": 2,
                        "last_failure": {"cause": "exited", "at": 1_700_000_100}}
    assert tiers[0]["last_failure"] is None and tiers[0]["up"]
    assert request(server.path, {"cmd": "guard"}) == {"rollbacks": 0}
    assert "known: fs" in request(server.path, {"cmd": "disable", "tier": "nope"})["error"]
    assert "unknown command" in request(server.path, {"cmd": "reboot"})["error"]


def test_a_switch_is_applied_by_the_owning_thread(server: ControlServer) -> None:
    applied: list[tuple[str, bool, str]] = []
    stop = threading.Event()

    def owner() -> None:  # the scheduler thread: applies queued switches once per "step"
        while not stop.is_set():
            server.apply_pending(lambda t, e: applied.append((t, e, threading.current_thread().name)))
            stop.wait(0.01)

    thread = threading.Thread(target=owner, name="owner")
    thread.start()
    try:
        reply = request(server.path, {"cmd": "disable", "tier": "fs"})
    finally:
        stop.set()
        thread.join()
    assert reply == {"tier": "fs", "enabled": False, "applied": True}
    assert applied == [("fs", False, "owner")]
    # No step to apply it: the reply says so, and the next step does it.
    assert request(server.path, {"cmd": "enable", "tier": "fs"})["applied"] is False
    server.apply_pending(lambda t, e: applied.append((t, e, "late")))
    assert applied[-1] == ("fs", True, "late")


def test_ctl_finds_the_one_live_engine(
    server: ControlServer, capsys: pytest.CaptureFixture[str]
) -> None:
    (server.path.parent / "engine-1-dead.sock").touch()  # left by an engine that crashed
    assert main(["ctl", "--dir", str(server.path.parent), "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[:9] == ["fs", "enabled", "3", "300", "1000", "30.0%", "up", "2", "exited"]
    other = ControlServer(server.path.parent, [], KVTierMetrics(), None)
    try:
        assert main(["ctl", "--dir", str(server.path.parent), "list"]) == 2
        assert "several kvtier engines" in capsys.readouterr().err
        assert main(["ctl", "--socket", str(other.path), "guard"]) == 0
        assert '"configured": false' in capsys.readouterr().out
    finally:
        other.close()
    assert not other.path.exists()


def test_a_squatted_default_directory_does_not_stop_an_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without XDG_RUNTIME_DIR the default is `<temp>/kvtier-<uid>`, which any local user can
    create first (here: open to all, as another user's would be to us). The engine starts with a
    private directory beside it, and `kvtier ctl` finds its socket there."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squatted = default_control_dir()
    squatted.mkdir()
    squatted.chmod(0o777)
    directory = engine_control_dir(None)
    assert directory != squatted and directory.parent == tmp_path
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    with pytest.raises(ConfigError, match="control_dir"):
        engine_control_dir(str(squatted))  # a directory the operator named is never replaced
    server = ControlServer(directory, ["fs"], KVTierMetrics(), None)
    try:
        assert main(["ctl", "list"]) == 0
        assert capsys.readouterr().out.splitlines()[0].split()[0] == "tier"
    finally:
        server.close()


def test_a_control_directory_deeper_than_a_socket_path_still_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A socket path over the kernel's 108 bytes (a deep temp or configured directory) is bound
    and reached through its directory's descriptor: the engine starts, `kvtier ctl` finds it by
    `--dir` and by `--socket`, and closing removes it."""
    deep = engine_control_dir(str(tmp_path.joinpath(*["d" * 40] * 3)))
    server = ControlServer(deep, ["fs"], KVTierMetrics(), None)
    try:
        assert len(str(server.path)) >= 108  # an AF_UNIX path's room on Linux, NUL included
        assert stat.S_ISSOCK(server.path.stat().st_mode) and stat.S_IMODE(server.path.stat().st_mode) == 0o600
        assert main(["ctl", "--dir", str(deep), "list"]) == 0
        assert capsys.readouterr().out.splitlines()[1].split()[0] == "host"
        assert main(["ctl", "--socket", str(server.path), "guard"]) == 0
        assert '"configured": false' in capsys.readouterr().out
    finally:
        server.close()
    assert not server.path.exists()
