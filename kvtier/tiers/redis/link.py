"""The redis tier's link to its server: the connection pool, pipelined round trips, and up/down state.

`RedisLink` builds redis-py's pool from the tier's `url` (one connection per thread, no hidden
retries), checks the server with a PING at startup (ConfigError naming `url` when it fails), and
runs pipelines: many commands in one write, then one reply per command. A connection error or
timeout marks the server down for `reconnect_interval_s`: meanwhile every pipeline answers NO_REPLY
at once, then the next one reconnects. A connection that broke while idle (the server restarted)
gets one fresh try first. The password in `url` never appears in logs, errors or reprs (`scrub`).

A connection (`Wire`) is opened by redis-py (TCP, unix socket or TLS, AUTH, SELECT), then its
socket is the link's: blocking with the kernel's timeouts, every reply read by one `ReplyReader`.
A thread may send a second round before reading the first's replies (`start`, then `finish` in
the order sent): the server never waits for the client's turnaround. A round whose connection broke
under an earlier round fails with it.

Threads: any; each caller brings its own connection (`connection()`); the down state has its lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url as _redis_parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvtier.errors import ConfigError
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.redis.wire import ReplyReader, own_socket, redact_url, send_buffers

_parse_url = cast(Callable[[str], dict[str, Any]], _redis_parse_url)
"""redis-py's own URL parser (untyped there): scheme, host or path, credentials, query arguments."""
_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class Link(Protocol):
    """What the tier and its chunk store use of their servers: one (`RedisLink`) or a cluster
    (`cluster.ClusterLink`). Any thread; a connection belongs to the thread that asked for it."""

    url: str
    """The server's URL, or the cluster's seed URLs, without passwords."""
    faillog: FailureLog

    def connection(self) -> Any:
        """A new connection for one thread (`disconnect()` closes it)."""

    def start(self, conn: Any, op: str, keys: Sequence[bytes], commands: Sequence[Any]) -> Any:
        """The sending half of `pipeline`: what `finish` takes (rounds are finished in the order
        they were started on a connection)."""

    def finish(self, sent: Any, read_reply: Callable[[ReplyReader, int], Any] | None = None) -> list[Any]:
        """The reading half of `pipeline`."""

    def pipeline(self, conn: Any, op: str, keys: Sequence[bytes], commands: Sequence[Any],
                 read_reply: Callable[[ReplyReader, int], Any] | None = None) -> list[Any]:
        """One reply per command, NO_REPLY where none came (see `RedisLink.pipeline`)."""

    def is_down(self) -> bool:
        """Whether every server is taken as down: nothing can answer now."""

    def any_down(self) -> bool:
        """Whether some server is taken as down."""

    def close(self) -> None:
        """Close every connection of the pools."""


class _NoReply:
    """The reply of a command that got none (connection error, server marked down)."""


NO_REPLY = _NoReply()


class Wire:
    """One thread's connection to one server: redis-py's connection opens it, then its socket is
    ours (`own_socket`) and its replies are read by `reader`. `epoch` counts the disconnects (a
    round sent before one lost its replies); `in_flight` the rounds sent and not yet read."""

    def __init__(self, conn: Any, timeout_s: float) -> None:
        self.conn = conn
        self._timeout_s = timeout_s
        self.reader: ReplyReader | None = None
        self.epoch = 0
        self.in_flight = 0

    def open(self) -> Any:
        """The socket, connected first when it is not."""
        if self.reader is None:
            self.conn.connect_check_health(check_health=False)
            own_socket(self.conn._sock, self._timeout_s)
            self.reader = ReplyReader(self.conn._sock)
        return self.conn._sock

    def disconnect(self) -> None:
        self.conn.disconnect()
        self.reader = None
        self.epoch += 1
        self.in_flight = 0


@dataclass
class Round:
    """One pipeline round trip to one server: what was sent, on which connection, and how it went."""

    conn: Wire
    op: str
    commands: Sequence[Any]
    was_connected: bool
    """Whether the connection was open before (a broken one gets one fresh try)."""
    epoch: int = 0
    """The connection's epoch when this round was sent."""
    retried: bool = False
    failed: bool = False


class RedisLink:
    """The pool of connections to one server, and whether that server is taken as down."""

    def __init__(
        self, url: str, *, connections: int, socket_timeout_s: float, connect_timeout_s: float,
        reconnect_interval_s: float, book: TierBook, on_down: Callable[[], None], probe: bool = True,
        password: str | None = None,
    ) -> None:
        """`password` (from the tier's `password_file`) is used in place of one in `url`."""
        self.url = redact_url(url)
        given = [urlsplit(url).password, dict(parse_qsl(urlsplit(url).query)).get("password"), password]
        self._secrets = {form for pw in given if pw for form in (pw, unquote(pw))}
        self.reconnect_interval_s = float(reconnect_interval_s)
        self._socket_timeout_s = float(socket_timeout_s)
        self._book = book
        self._on_down = on_down
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down_cause = ""
        self.faillog = FailureLog(book.ctx.log, f"redis tier {book.ctx.tier_name} ({self.url})",
                                  self.scrub)
        try:
            # Query arguments in the URL (ssl_ca_certs=..., socket_timeout=...) win, except the
            # ones the threading model depends on: one connection per thread, no hidden retries.
            kwargs: dict[str, Any] = {"socket_timeout": socket_timeout_s,
                                      "socket_connect_timeout": connect_timeout_s, **_parse_url(url)}
            kwargs.update(max_connections=connections, retry=Retry(NoBackoff(), 0))
            if password is not None:
                kwargs["password"] = password
            self._pool = redis.ConnectionPool(**kwargs)
        except (ValueError, TypeError, RedisError) as e:
            raise ConfigError("url", self.url, self.scrub(f"not a usable redis URL: {e}")) from None
        if probe:
            self._probe()

    def scrub(self, text: str) -> str:
        """`text` without the password, should a message from below ever quote it."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def ask(self, *command: Any) -> Any:
        """One command on a fresh connection, outside the pipelines: its reply, or the error raised
        (RedisError or OSError). For setup: the startup PING, a cluster's slot map. The connection
        is the pool's kind but not counted in it: the pool keeps one per thread."""
        conn: Any = self._pool.connection_class(**self._pool.connection_kwargs)
        try:
            conn.send_command(*command)
            return conn.read_response(disable_decoding=True)
        finally:
            conn.disconnect()

    def _probe(self) -> None:
        """PING the server once; ConfigError naming `url` when it cannot be reached or refuses us."""
        try:
            reply = self.ask("PING")
        except (RedisError, OSError) as e:
            self._pool.disconnect()
            why = f"redis server did not answer PING: {type(e).__name__}: {e}"
            raise ConfigError("url", self.url, self.scrub(why)) from None
        if reply not in (b"PONG", "PONG"):
            raise ConfigError("url", self.url, f"unexpected PING reply {reply!r}")

    def connection(self) -> Wire:
        """A new connection of the pool's kind, for one thread."""
        return Wire(self._pool.make_connection(), self._socket_timeout_s)

    def is_down(self) -> bool:
        with self._lock:
            return time.monotonic() < self._down_until

    def any_down(self) -> bool:
        return self.is_down()

    def close(self) -> None:
        self._pool.disconnect()

    def pipeline(
        self, conn: Any, op: str, keys: Sequence[bytes], commands: Sequence[Any],
        read_reply: Callable[[ReplyReader, int], Any] | None = None,
    ) -> list[Any]:
        """Send `commands` (argument tuples, or lists of pre-framed buffers) in one gathered write,
        read one reply per command: the value, a ResponseError, or NO_REPLY when there was none (the
        server is down or was just marked down by a connection error). `keys` are the commands' Redis
        keys (a cluster routes by them; one server has no use for them). `read_reply(reader, n)`,
        when given, reads the reply to command `n` itself, straight from the socket."""
        return self.finish(self.start(conn, op, keys, commands), read_reply)

    def start(self, conn: Wire, op: str, keys: Sequence[bytes], commands: Sequence[Any]) -> Round:
        """The sending half of `pipeline`: `finish` reads the replies (a cluster sends to every node
        before it reads from any; a thread may send its next round first)."""
        sent = Round(conn, op, commands, was_connected=conn.reader is not None)
        if self.is_down():
            sent.failed = True
        else:
            self._send(sent)
        return sent

    def _send(self, sent: Round) -> None:
        wire = sent.conn
        try:
            buffers: list[Any] = []
            for cmd in sent.commands:
                buffers.extend(cmd if isinstance(cmd, list) else wire.conn.pack_command(*cmd))
            sock = wire.open()
            sent.epoch = wire.epoch
            wire.in_flight += 1
            send_buffers(sock, buffers)
        except Exception as e:
            self._failed(sent, e, [])

    def finish(self, sent: Round, read_reply: Callable[[ReplyReader, int], Any] | None = None) -> list[Any]:
        """The reading half of `pipeline`, for what `start` sent."""
        n = len(sent.commands)
        wire = sent.conn
        replies: list[Any] = []
        while not sent.failed:
            replies = []
            if wire.epoch != sent.epoch or wire.reader is None:
                sent.failed = True  # the connection broke under an earlier round: already counted
                break
            reader = wire.reader
            try:
                for i in range(n):
                    replies.append(reader.reply() if read_reply is None else read_reply(reader, i))
                wire.in_flight -= 1
                if not wire.in_flight and not reader.idle():
                    raise RedisConnectionError("unexpected bytes after the pipeline's replies")
            except Exception as e:
                self._failed(sent, e, replies)
                continue
            self._mark_up()
            break
        return replies + [NO_REPLY] * (n - len(replies))

    def _failed(self, sent: Round, exc: Exception, replies: list[Any]) -> None:
        """After an error: a connection that broke while idle (the server restarted) gets one fresh
        try, sent again at once (every command here is idempotent, and no reply was used); else
        the round fails, and a connection error or timeout marks the server down."""
        sent.conn.disconnect()
        stale = isinstance(exc, RedisConnectionError | ConnectionError)
        if stale and sent.was_connected and not sent.retried and not replies:
            sent.retried = True
            self._send(sent)
            return
        sent.failed = True
        if isinstance(exc, _DOWN_ERRORS):
            self._mark_down(sent.op, exc)
        else:  # a bug must fail the keys, never lose the jobs or the thread
            self.faillog.failed(f"{sent.op}:{type(exc).__name__}", exc)

    def _mark_down(self, op: str, exc: BaseException) -> None:
        cause = f"{op}:{type(exc).__name__}"
        with self._lock:
            self._down_until = time.monotonic() + self.reconnect_interval_s
            self._down_cause = cause
        self._on_down()  # what the server held before may be gone (restart)
        self._book.count(TierCounter.CONNECTION_ERRORS)
        self.faillog.failed(cause, exc)

    def _mark_up(self) -> None:
        with self._lock:
            if not self._down_cause:
                return
            cause, self._down_cause = self._down_cause, ""
        self._book.ctx.log.info("redis tier %s: %s answers again (after %s)", self._book.ctx.tier_name,
                                self.url, cause)
