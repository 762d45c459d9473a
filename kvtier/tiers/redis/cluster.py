"""A Redis/Valkey Cluster behind the redis tier: the slot map, routing by key slot, MOVED and ASK.

`ClusterLink` gives the tier what `RedisLink` gives it for one server (`link.Link`). At startup the
first seed URL that answers CLUSTER SLOTS gives the slot map; a seed that is not a cluster node is a
ConfigError naming the option and the URL, and so is a cluster that serves no slot or no seed that
answers. Every node is reached with the first seed's scheme, credentials and query arguments.

A pipeline groups its commands by the node that serves each key's slot (CRC16 of the key mod 16384,
hash tags as Redis defines them; a chunk is one key, so each chunk lives whole on one node), sends
each node its part, then reads each node's replies: the nodes work in parallel. A `MOVED` reply
moves that slot in the map at once and asks for a full refresh; an `ASK` reply (a slot being
migrated) sends `ASKING` and the command to the named node, that time only. After `MAX_REDIRECTS`
hops the last error is the command's reply, a failure.

Each node has its own `RedisLink`, so its own up/down state: a node that dies fails the commands of
its slots only (NO_REPLY: a store fails, a load fails, a lookup answers MISS) and the other nodes
keep serving; its link reconnects after `reconnect_interval_s`, as for one server. While a node is
down the map is refreshed at most every `reconnect_interval_s` (a failover may have handed its slots
to a replica). Routing decides only where to ask: every value read is still verified by the chunk
store. For a cluster without replicas, its nodes need `cluster-require-full-coverage no`, or the
live nodes refuse every key once one node is marked failed.

A round (`start`, then `finish`) may be sent while the same thread's previous round is unread, as
on one server: redirected commands and map refreshes therefore go over a second connection per
node (`ClusterConnection.hops`), whose replies never queue behind a round's.

Threads: any. A connection (`ClusterConnection`) belongs to one thread and holds one connection per
node it used; the map is replaced whole (readers need no lock) and updated under `_lock`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.crc import key_slot
from redis.exceptions import AskError, MovedError, RedisError, ResponseError

from kvtier.errors import ConfigError
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.redis.link import NO_REPLY, RedisLink, Round, Wire
from kvtier.tiers.redis.wire import ReplyReader, redact_url

SLOTS = 16384
MAX_REDIRECTS = 3
"""Redirects followed for one command in one pipeline (a slot moved, then being migrated: 2)."""
REFRESH_MIN_INTERVAL_S = 0.05
"""The shortest time between two refreshes of the whole map (MOVED replies arrive in bursts)."""
Addr = tuple[str, int]


class ClusterConnection:
    """One thread's connections to the cluster: one per node it has used for rounds (`by_node`), and
    one for redirects and map refreshes (`hops`)."""

    def __init__(self) -> None:
        self.by_node: dict[Addr, Wire] = {}
        self.hops: dict[Addr, Wire] = {}

    def disconnect(self) -> None:
        for conn in [*self.by_node.values(), *self.hops.values()]:
            conn.disconnect()


@dataclass
class Pending:
    """A round sent to the nodes and not read yet: the commands' replies so far, which commands
    went to which node, and each node's round."""

    conn: ClusterConnection
    op: str
    commands: Sequence[Any]
    replies: list[Any]
    groups: dict[Addr, list[int]]
    sent: list[tuple[Round, list[int | None]]]


def redirect(reply: object) -> tuple[str, int, Addr] | None:
    """("MOVED" or "ASK", slot, node) when `reply` is a redirect error (redis-py's `MovedError` and
    `AskError`, or a `ResponseError` with the server's text, from `ReplyReader`), else None."""
    if isinstance(reply, AskError):
        kind = "MOVED" if isinstance(reply, MovedError) else "ASK"
        return kind, int(reply.slot_id), (str(reply.host), int(reply.port))
    if not isinstance(reply, ResponseError):
        return None
    kind, _, rest = str(reply).partition(" ")
    slot, _, where = rest.strip().partition(" ")
    host, _, port = where.rpartition(":")
    if kind not in ("MOVED", "ASK") or not (slot.isdigit() and port.isdigit() and host):
        return None
    return kind, int(slot), (host.strip("[]"), int(port))


class ClusterLink:
    """The cluster's nodes, each a `RedisLink`, and the slot map that routes keys to them."""

    def __init__(
        self, seeds: Sequence[str], *, option: str, connections: int, socket_timeout_s: float,
        connect_timeout_s: float, reconnect_interval_s: float, book: TierBook, on_down: Callable[[], None],
        password: str | None = None,
    ) -> None:
        self.url = ", ".join(redact_url(u) for u in seeds)
        self._option = option
        self._template = urlsplit(seeds[0])
        self._link_options: dict[str, Any] = dict(
            connections=connections, socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s,
            reconnect_interval_s=reconnect_interval_s, book=book, on_down=on_down, probe=False,
            password=password)
        self.reconnect_interval_s = float(reconnect_interval_s)
        self._lock = threading.Lock()
        self._links: dict[Addr, RedisLink] = {}
        self._slots: list[Addr | None] = [None] * SLOTS
        self._nodes: frozenset[Addr] = frozenset()
        """The nodes `_slots` names (a node a MOVED named stays until the next full refresh)."""
        self._refresh_due = float("inf")
        self._last_refresh = time.monotonic()
        self._refreshing = False
        self.faillog = FailureLog(book.ctx.log, f"redis tier {book.ctx.tier_name} (cluster {self.url})",
                                  self.scrub)
        try:
            self._discover(seeds)
        except BaseException:
            self.close()
            raise

    def scrub(self, text: str) -> str:
        """`text` without the password (every node is reached with the first seed's)."""
        with self._lock:
            links = list(self._links.values())[:1]
        return links[0].scrub(text) if links else text

    # ---- the map -------------------------------------------------------------------------------

    def _discover(self, seeds: Sequence[str]) -> None:
        """The slot map from the first seed that answers CLUSTER SLOTS; ConfigError otherwise."""
        why: list[str] = []
        for url in seeds:
            parts = urlsplit(url)
            try:
                addr = (parts.hostname or "127.0.0.1", parts.port or 6379)
            except ValueError as e:
                raise ConfigError(self._option, redact_url(url), f"not a usable redis URL: {e}") from None
            link = self._link(addr)
            try:
                reply = link.ask("CLUSTER", "SLOTS")
            except ResponseError as e:
                if "cluster" in str(e).lower():
                    raise ConfigError(self._option, redact_url(url), (
                        "not a node of a Redis/Valkey Cluster (the server says: "
                        f"{link.scrub(str(e))}); give a cluster node, or set cluster to false")) from None
                why.append(f"{redact_url(url)}: {link.scrub(str(e))}")
                continue
            except (RedisError, OSError) as e:
                why.append(f"{redact_url(url)}: {type(e).__name__}: {link.scrub(str(e))}")
                continue
            if self._install(reply, addr[0]):
                return
            why.append(f"{redact_url(url)}: the cluster serves no slot yet")
        raise ConfigError(self._option, self.url, "no seed node gave the cluster's slot map: "
                          + "; ".join(why))

    def _install(self, reply: Any, asked_host: str) -> bool:
        """Install a CLUSTER SLOTS reply as the map; False when it serves no slot."""
        if not isinstance(reply, list):
            return False
        slots: list[Addr | None] = [None] * SLOTS
        for entry in reply:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0] or "")
            addr = (host if host not in ("", "?") else asked_host, int(master[1]))
            slots[start : end + 1] = [addr] * (end + 1 - start)
        nodes = frozenset(a for a in slots if a is not None)
        if not nodes:
            return False
        for node in nodes:
            self._link(node)
        with self._lock:
            self._slots, self._nodes = slots, nodes
        return True

    def _link(self, addr: Addr) -> RedisLink:
        """The link to the node at `addr` (made on first use: a node the map names later)."""
        with self._lock:
            link = self._links.get(addr)
            if link is None:
                host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
                userinfo = self._template.netloc.rpartition("@")[0]
                netloc = f"{userinfo}@{host}:{addr[1]}" if userinfo else f"{host}:{addr[1]}"
                url = urlunsplit((self._template.scheme, netloc, "", self._template.query, ""))
                link = self._links[addr] = RedisLink(url, **self._link_options)
            return link

    def _refresh(self, conn: ClusterConnection) -> None:
        """Ask a live node for the whole map when one is due (after MOVED, or a node down)."""
        now = time.monotonic()
        with self._lock:
            since = now - self._last_refresh
            if self._refreshing or since < REFRESH_MIN_INTERVAL_S:
                return
            moved = self._refresh_due <= now
            if not moved and since < self.reconnect_interval_s:
                return
            mapped = self._mapped()
            if not moved and not any(link.is_down() for link in mapped.values()):
                return
            self._refreshing = True
            self._refresh_due, self._last_refresh = float("inf"), now
        links = [(a, link) for a, link in mapped.items() if not link.is_down()]
        try:
            for addr, link in links:
                reply = link.pipeline(self._conn(conn.hops, addr), "slots", [b""], [("CLUSTER", "SLOTS")])[0]
                if reply is not NO_REPLY and not isinstance(reply, ResponseError) and self._install(
                        reply, addr[0]):
                    return
        finally:
            with self._lock:
                self._refreshing = False

    def _mapped(self) -> dict[Addr, RedisLink]:
        """The links of the nodes the map names now: only these are asked for the map and counted
        as down (a seed that did not answer at startup keeps its link, unused unless the map names
        it later). Lock held."""
        return {a: link for a, link in self._links.items() if a in self._nodes}

    def _moved(self, slot: int, addr: Addr) -> None:
        self._link(addr)
        with self._lock:
            slots = list(self._slots)
            slots[slot] = addr
            self._slots, self._nodes = slots, self._nodes | {addr}
            self._refresh_due = min(self._refresh_due, time.monotonic())

    # ---- the Link interface --------------------------------------------------------------------

    def connection(self) -> ClusterConnection:
        return ClusterConnection()

    def _conn(self, conns: dict[Addr, Wire], addr: Addr) -> Wire:
        c = conns.get(addr)
        if c is None:
            c = conns[addr] = self._link(addr).connection()
        return c

    def pipeline(
        self, conn: ClusterConnection, op: str, keys: Sequence[bytes], commands: Sequence[Any],
        read_reply: Callable[[ReplyReader, int], Any] | None = None,
    ) -> list[Any]:
        """Route each command to the node serving its key's slot, one round trip per node (sent to
        every node before any reply is read), and follow redirects (see the module docstring); one
        reply per command, as `RedisLink`'s."""
        return self.finish(self.start(conn, op, keys, commands), read_reply)

    def start(self, conn: ClusterConnection, op: str, keys: Sequence[bytes],
              commands: Sequence[Any]) -> Pending:
        """The sending half of `pipeline`: each node's part sent on the thread's connection to it."""
        self._refresh(conn)
        replies: list[Any] = [NO_REPLY] * len(commands)
        slots = self._slots
        where = {i: slots[key_slot(k)] for i, k in enumerate(keys)}
        groups = self._group(where, replies)
        sent = [self._start(conn.by_node, addr, op, idx, commands, set()) for addr, idx in groups.items()]
        return Pending(conn, op, commands, replies, groups, sent)

    def finish(self, pending: Pending,
               read_reply: Callable[[ReplyReader, int], Any] | None = None) -> list[Any]:
        """The reading half of `pipeline`: each node's replies, then the redirects followed over the
        `hops` connections, one hop at a time."""
        replies = pending.replies
        groups, sent = pending.groups, pending.sent
        for _ in range(MAX_REDIRECTS + 1):
            for (addr, idx), (round_, order) in zip(groups.items(), sent, strict=True):
                got = self._finish(addr, round_, order, read_reply)
                for i, reply in zip(idx, got, strict=True):
                    replies[i] = reply
            where, asking = self._redirects(groups.values(), replies)
            if not where:
                break
            groups = self._group(where, replies)
            sent = [self._start(pending.conn.hops, addr, pending.op, idx, pending.commands, asking)
                    for addr, idx in groups.items()]
        return replies

    @staticmethod
    def _group(where: dict[int, Addr | None], replies: list[Any]) -> dict[Addr, list[int]]:
        """The commands `where` sends, by node; a command whose slot no node serves gets its error."""
        groups: dict[Addr, list[int]] = {}
        for i, addr in where.items():
            if addr is None:
                replies[i] = ResponseError("CLUSTERDOWN no node serves this key's slot")
            else:
                groups.setdefault(addr, []).append(i)
        return groups

    def _redirects(self, sent: Iterable[list[int]],
                   replies: list[Any]) -> tuple[dict[int, Addr | None], set[int]]:
        """Where each redirected command of `sent` goes next (MOVED updates the map at once), and
        which of them need ASKING first."""
        where: dict[int, Addr | None] = {}
        asking: set[int] = set()
        for i in [i for idx in sent for i in idx]:
            if (hop := redirect(replies[i])) is not None:
                kind, slot, addr = hop
                if kind == "MOVED":
                    self._moved(slot, addr)
                else:
                    asking.add(i)
                where[i] = addr
        return where, asking

    def _start(self, conns: dict[Addr, Wire], addr: Addr, op: str, idx: list[int], commands: Sequence[Any],
               asking: set[int]) -> tuple[Round, list[int | None]]:
        """Send commands `idx` to one node over `conns`, those in `asking` after an ASKING; the
        round, and the command each position carries (None: an ASKING)."""
        order: list[int | None] = []
        for i in idx:
            order += [None, i] if i in asking else [i]
        cmds = [("ASKING",) if i is None else commands[i] for i in order]
        return self._link(addr).start(self._conn(conns, addr), op, [], cmds), order

    def _finish(self, addr: Addr, round_: Round, order: list[int | None],
                read_reply: Callable[[ReplyReader, int], Any] | None) -> list[Any]:
        """The replies to what `_start` sent, in the order of its `idx` (ASKING replies dropped)."""
        read: Callable[[ReplyReader, int], Any] | None = None
        if read_reply is not None:
            outer = read_reply

            def read(reader: ReplyReader, n: int) -> Any:
                i = order[n]
                return reader.line() if i is None else outer(reader, i)

        got = self._link(addr).finish(round_, read)
        return [reply for i, reply in zip(order, got, strict=True) if i is not None]

    def is_down(self) -> bool:
        """Whether every node the map names is taken as down."""
        with self._lock:
            links = list(self._mapped().values())
        return all(link.is_down() for link in links)

    def any_down(self) -> bool:
        """Whether some node the map names is taken as down."""
        with self._lock:
            links = list(self._mapped().values())
        return any(link.is_down() for link in links)

    def close(self) -> None:
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.close()
