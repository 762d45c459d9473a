"""The operator's control socket: list tiers with state and fill, switch a tier, show the SLO guard.

One Unix stream socket per engine, `engine-<pid>-<random>.sock` in a directory only its owner may enter
(created 0700; refused when it belongs to someone else or others may enter it); the socket itself
is 0600 from its creation, and every connection's peer must run as the same user (SO_PEERCRED).
Nothing is reachable from the network. A socket path longer than the kernel takes (108 bytes, a
deep temp or configured directory) is bound and reached through its directory's descriptor
(`unix_address`), so no directory is too deep for an engine to start in. Each connection carries
one JSON request line and gets one JSON reply line (`kvtier ctl` is the client):

- `{"cmd": "list"}` → `{"tiers": [{"tier", "enabled", "used_bytes", "used_chunks",
  "capacity_bytes", "used_fraction", "up", "restarts", "last_failure"}, ...]}` (the host tier
  first, then the secondary tiers in configured order; `last_failure` is null or {"cause",
  "at"}: the latest `kvtier_tier_last_failure` series, its cause and Unix time).
- `{"cmd": "guard"}` → the SLO guard's `state()`, or `{"configured": false}`.
- `{"cmd": "disable" | "enable", "tier": NAME}` → `{"tier", "enabled", "applied"}`.

Threading: the server answers on its own thread. Reads come from thread-safe sources (the metrics
snapshot, the guard's state). A switch is queued for the scheduler thread, which owns the manager
and applies it at its next engine step (`apply_pending`); the reply waits up to `apply_wait_s`
for that and says whether it happened (an idle engine applies it at its next step, before any load
or store).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import secrets
import socket
import stat
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.format.chunks import HOST
from kvtier.ops.metrics import KVTierMetrics

log = logging.getLogger("kvtier.ops.control_server")

FILL = ("used_bytes", "used_chunks", "capacity_bytes", "used_fraction")
MAX_REQUEST = 4096
SUN_PATH_BYTES = 108
"""The size of an AF_UNIX address's path field on Linux, its terminating NUL included."""


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """`path` as an address to bind or connect to: itself when it fits `SUN_PATH_BYTES`, else the
    same name through `/proc/self/fd/N/` where N is a descriptor of its directory, held open until
    the block ends (the kernel resolves the name when the call is made)."""
    if len(os.fsencode(path)) < SUN_PATH_BYTES:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def default_control_dir() -> Path:
    """`$XDG_RUNTIME_DIR/kvtier`, else `<temp dir>/kvtier-<uid>`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kvtier"
    return Path(tempfile.gettempdir()) / f"kvtier-{os.getuid()}"


def engine_control_dir(configured: str | None) -> Path:
    """Where this engine's control socket goes: `configured` (which must be private: ConfigError
    otherwise), else the default. Anyone may create the default's path in a shared temp directory
    before us: when it is not ours, a fresh private directory beside it (`kvtier-<uid>-<random>`,
    which `control_dirs` lists), named in a warning, so that nobody can keep an engine from
    starting."""
    if configured:
        return private_dir(Path(configured))
    default = default_control_dir()
    try:
        return private_dir(default)
    except ConfigError as exc:
        fallback = Path(tempfile.mkdtemp(prefix=f"kvtier-{os.getuid()}-"))
        log.warning("kvtier: %s; the control socket goes to %s instead", exc, fallback)
        return fallback


def control_dirs() -> list[Path]:
    """The directories engines of this user put their sockets in by default: the default one and
    the private fallbacks `engine_control_dir` made beside it."""
    default = default_control_dir()
    found = [default]
    for path in sorted(Path(tempfile.gettempdir()).glob(f"kvtier-{os.getuid()}-*")):
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            found.append(path)
    return found


def private_dir(path: Path) -> Path:
    """Create `path` 0700 if absent; raise ConfigError when it is not a directory of ours that
    only we may enter."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError("control_dir", str(path), "must be a directory owned by this user")
    if info.st_mode & 0o077:
        raise ConfigError("control_dir", str(path), "must not be accessible to others (chmod 700)")
    return path


class Switch:
    """One queued tier switch and the event its application sets."""

    def __init__(self, tier: str, enabled: bool) -> None:
        self.tier = tier
        self.enabled = enabled
        self.done = threading.Event()


class ControlServer:
    """The control socket of one engine; `close()` is idempotent."""

    def __init__(
        self, directory: Path, tiers: Sequence[str], metrics: KVTierMetrics,
        guard_state: Callable[[], dict[str, Any]] | None, apply_wait_s: float = 2.0,
    ) -> None:
        self.path = private_dir(directory) / f"engine-{os.getpid()}-{secrets.token_hex(4)}.sock"
        self.tiers = tuple(tiers)
        self.metrics = metrics
        self.guard_state = guard_state
        self.apply_wait_s = apply_wait_s
        self._pending: queue.SimpleQueue[Switch] = queue.SimpleQueue()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            with unix_address(self.path) as address:
                self._sock.bind(address)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._sock.listen(8)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvtier-control", daemon=True)
        self._thread.start()

    def apply_pending(self, apply: Callable[[str, bool], None]) -> None:
        """Apply every queued switch with `apply(tier, enabled)`. Scheduler thread, every step."""
        while True:
            try:
                switch = self._pending.get_nowait()
            except queue.Empty:
                return
            apply(switch.tier, switch.enabled)
            switch.done.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=2.0)
        self.path.unlink(missing_ok=True)

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5.0)
                    reply = self._answer(conn)
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError as e:
                    log.debug("control connection failed: %s", e)

    def _answer(self, conn: socket.socket) -> dict[str, Any]:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            return {"error": "permission denied"}
        data = b""
        while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
            chunk = conn.recv(MAX_REQUEST)
            if not chunk:
                break
            data += chunk
        try:
            request = json.loads(data)
        except ValueError:
            return {"error": "the request must be one JSON object"}
        if not isinstance(request, dict):
            return {"error": "the request must be one JSON object"}
        return self.handle(request)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """The reply to one request (see the module docstring)."""
        cmd = request.get("cmd")
        if cmd == "list":
            return {"tiers": self._tiers()}
        if cmd == "guard":
            return self.guard_state() if self.guard_state else {"configured": False}
        if cmd in ("disable", "enable"):
            tier = request.get("tier")
            if tier not in self.tiers:
                return {"error": f"no secondary tier named {tier!r}; known: {', '.join(self.tiers)}"}
            switch = Switch(str(tier), cmd == "enable")
            self._pending.put(switch)
            applied = switch.done.wait(self.apply_wait_s)
            return {"tier": tier, "enabled": switch.enabled, "applied": applied}
        return {"error": f"unknown command {cmd!r}; known: list, guard, disable, enable"}

    def _tiers(self) -> list[dict[str, Any]]:
        values = self.metrics.snapshot()
        rows = []
        for tier in (HOST, *self.tiers):
            row: dict[str, Any] = {"tier": tier}
            enabled = values.get(f'kvtier_tier_enabled{{tier="{tier}"}}', 1.0)
            row["enabled"] = tier == HOST or enabled == 1.0
            for name in FILL:
                row[name] = values.get(f'kvtier_{name}{{tier="{tier}"}}', 0.0)
            row["up"] = values.get(f'kvtier_tier_up{{tier="{tier}"}}', 1.0) == 1.0
            row["restarts"] = int(values.get(f'kvtier_tier_restarts{{tier="{tier}"}}', 0.0))
            row["last_failure"] = _last_failure(values, tier)
            rows.append(row)
        return rows


def _last_failure(values: dict[str, float], tier: str) -> dict[str, Any] | None:
    """The cause and time of `tier`'s latest `kvtier_tier_last_failure` series, or None."""
    latest: dict[str, Any] | None = None
    for key, at in values.items():
        if key.startswith("kvtier_tier_last_failure{") and f'tier="{tier}"' in key:
            cause = key.split('cause="', 1)[1].split('"', 1)[0]
            if latest is None or at > latest["at"]:
                latest = {"cause": cause, "at": at}
    return latest


def request(path: Path, message: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Send one request to the control socket at `path`; the decoded reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        with unix_address(path) as address:
            sock.connect(address)
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    reply: dict[str, Any] = json.loads(data)
    return reply
