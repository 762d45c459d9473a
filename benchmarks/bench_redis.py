"""redis tier throughput next to two raw clients (redis-py, and a bare RESP socket), in one run.

    python -m benchmarks.bench_redis --chunks 128 --chunk-bytes 2097152 --threads 4 --repeats 5

Starts its own redis-server (loopback TCP, persistence off) unless `--url` names one. Each repeat
runs every contender, in rotating order, against an emptied server (FLUSHALL before each). Every
raw contender uses `threads` threads, each with its own connection, and SETs then GETs the same
number of values of the same size as the tier stores (chunk + 4 KiB header), `depth` values per
round trip (the tier's batch at this size: values while they stay under `batch_bytes`); the
`-deep` variants send each thread's whole share in one round trip.

- redis-py: `redis.Redis` (hiredis parser and packer), `pipeline(transaction=False)`, ready-made
  `bytes` values; GET results are only received.
- resp: the strongest client we can write in Python: a plain socket speaking RESP. A batch of SETs
  is one `sendmsg` (each command's header and its value as separate buffers, never joined), the
  `+OK` replies one `recv_into`; a batch of GETs is one send, and its replies one `recvmsg_into`
  with MSG_WAITALL straight into pre-touched rows (each reply's length line, its value, its CRLF).
  Values go out from, and come back into, distinct pre-touched page-aligned rows of one buffer as
  large as the tier's host region (same memory traffic). Its reads rely on every value having the
  known size, and check each length line.
- resp-one-buffer: resp with each batch of SETs framed beforehand into one contiguous buffer (the
  rows copied in before the timer starts), sent with one `sendall`.
- resp-stream (`raw_stream`, the contender of issue 38): one socket per thread; for each value a
  `SET` header, then the row's own memory with `sendall(memoryview)`, then CRLF, every reply read
  after the thread's whole share was sent; loads the same way (every GET sent, then each value
  read with `recv_into` straight into its row). With `--cluster`, `resp-stream-cluster`: the same
  with a socket per thread and node, each key sent to the node serving its slot.
- tier: `kvtier tier-bench --tier redis --url URL --chunk-bytes N --chunks K --threads T --json`
  (a real tier process over a real host region: rows go out from and come back into the region,
  with the header checksummed on store and verified on load).

`--before-tree DIR` adds `tier-before`: the same tier-bench run from the kvtier source in DIR (a
`git archive` of the commit before a change), interleaved with the others.

`--cluster` starts a three-master cluster (`tests/services/redis_cluster.py`) instead, and sets
the tier (`--option urls=[...]`) beside two bare RESP cluster clients (`raw_resp_cluster`): a socket
per thread and node, each round trip split by key slot over the nodes, sent to all of them before
any reply is read; `resp-cluster` takes the tier's batch per round trip, `resp-cluster-per-node`
that many values for every node. `--contenders` runs a subset of the raw contenders.

Throughput counts chunk payload bytes (the same for all). Prints a table and a JSON document with
every sample, the medians, and the ratio tier / best raw client (the highest median of the raw
contenders, per phase).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.crc import key_slot

from benchmarks import rawio
from kvtier.tiers.common import chunkfmt
from tests.services.redis_cluster import start_cluster
from tests.services.redis_server import start_server, stop_server

CRLF = memoryview(b"\r\n")
DEFAULT_BATCH_BYTES = 8 << 20
"""The redis tier's default `batch_bytes` (the raw client gets the same values per round trip)."""


def raw_redis_py(url: str, value_bytes: int, chunks: int, threads: int, depth: int) -> dict[str, float]:
    """Seconds for raw redis-py to SET then GET `chunks` values over `threads` connections."""
    shares = [list(range(t, chunks, threads)) for t in range(threads)]
    values = [os.urandom(value_bytes) for _ in range(min(chunks, 8))]
    clients = [redis.Redis.from_url(url) for _ in range(threads)]
    for c in clients:
        c.ping()

    def run(phase: str) -> float:
        def worker(t: int) -> None:
            share = shares[t]
            for j in range(0, len(share), depth):
                pipe = clients[t].pipeline(transaction=False)
                for i in share[j : j + depth]:
                    if phase == "set":
                        pipe.set(f"raw:{i}", values[i % len(values)])
                    else:
                        pipe.get(f"raw:{i}")
                replies = pipe.execute()
                if phase == "get" and any(len(r) != value_bytes for r in replies):
                    raise RuntimeError("a GET returned a value of the wrong size")

        return rawio.timed_threads(threads, worker)

    try:
        return {"store_s": run("set"), "load_s": run("get")}
    finally:
        for c in clients:
            c.close()


def _resp_connect(url: str) -> socket.socket:
    """A RESP connection to the server of a redis:// URL (AUTH when it has a password)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if parts.password:
        user = parts.username or "default"
        sock.sendall(b"*3\r\n$4\r\nAUTH\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (
            len(user), user.encode(), len(parts.password), parts.password.encode()))
        if sock.recv(64) != b"+OK\r\n":
            raise RuntimeError("AUTH refused")
    return sock


def raw_resp(url: str, value_bytes: int, chunks: int, threads: int, depth: int,
             one_buffer: bool = False) -> dict[str, float]:
    """Seconds for a bare RESP socket per thread to SET then GET `chunks` values (see the module
    docstring: gathered sends, scattered reads straight into pre-touched rows). `one_buffer`: each
    batch of SETs is framed into one contiguous buffer before the timer starts, and sent with one
    `sendall`."""
    shares = [list(range(t, chunks, threads)) for t in range(threads)]
    buf = rawio.rows(chunks, value_bytes)
    rows = [buf[i * value_bytes : (i + 1) * value_bytes] for i in range(chunks)]
    socks = [_resp_connect(url) for _ in range(threads)]
    bulk = b"$%d\r\n" % value_bytes

    def head(i: int) -> bytes:
        key = b"resp:%d" % i
        return b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n%b" % (len(key), key, bulk)

    framed = {share[j]: b"".join(head(i) + bytes(rows[i]) + b"\r\n" for i in share[j : j + depth])
              for share in shares for j in range(0, len(share), depth)} if one_buffer else {}

    def set_batch(sock: socket.socket, batch: list[int]) -> None:
        if one_buffer:
            sock.sendall(framed[batch[0]])
        else:
            rawio.send_parts(sock, [part for i in batch for part in (memoryview(head(i)), rows[i], CRLF)])
        replies = memoryview(bytearray(5 * len(batch)))
        rawio.recv_parts(sock, [replies])
        if bytes(replies) != b"+OK\r\n" * len(batch):
            raise RuntimeError(f"unexpected SET replies {bytes(replies[:40])!r}")

    def get_batch(sock: socket.socket, batch: list[int]) -> None:
        keys = [b"resp:%d" % i for i in batch]
        sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(k), k) for k in keys))
        heads = [memoryview(bytearray(len(bulk))) for _ in batch]
        ends = [memoryview(bytearray(2)) for _ in batch]
        rawio.recv_parts(sock, [part for n, i in enumerate(batch) for part in (heads[n], rows[i], ends[n])])
        if any(bytes(h) != bulk for h in heads):
            raise RuntimeError("a GET reply is not a value of the expected size")

    def run(op: Callable[[socket.socket, list[int]], None]) -> float:
        def worker(t: int) -> None:
            for j in range(0, len(shares[t]), depth):
                op(socks[t], shares[t][j : j + depth])

        return rawio.timed_threads(threads, worker)

    try:
        return {"store_s": run(set_batch), "load_s": run(get_batch)}
    finally:
        for sock in socks:
            sock.close()


def raw_resp_cluster(urls: list[str], value_bytes: int, chunks: int, threads: int, depth: int,
                     per_node: bool = False) -> dict[str, float]:
    """Seconds for a bare RESP cluster client to SET then GET `chunks` values: per thread a socket
    per node. A round trip takes the thread's next `depth` values (as the tier's batch), or with
    `per_node` up to `depth` values for every node, splits them by the node serving their slot
    (CRC16, from one CLUSTER SLOTS), sends to every node (framed as `raw_resp`'s), then reads every
    node's replies."""
    with redis.Redis.from_url(urls[0]) as admin:
        owners: list[str] = [""] * 16384
        for start, end, master, *_ in admin.execute_command("CLUSTER", "SLOTS"):
            first, last = int(start), int(end)
            owners[first : last + 1] = [f"redis://127.0.0.1:{int(master[1])}"] * (last + 1 - first)
    keys = [b"resp:%d" % i for i in range(chunks)]
    node_of = [owners[key_slot(k)] for k in keys]
    shares = [list(range(t, chunks, threads)) for t in range(threads)]
    buf = rawio.rows(chunks, value_bytes)
    rows = [buf[i * value_bytes : (i + 1) * value_bytes] for i in range(chunks)]
    socks = [{node: _resp_connect(node) for node in set(node_of)} for _ in range(threads)]
    bulk = b"$%d\r\n" % value_bytes

    def set_batch(conns: dict[str, socket.socket], batch: list[int]) -> None:
        by_node: dict[str, list[int]] = {}
        for i in batch:
            by_node.setdefault(node_of[i], []).append(i)
        for node, part in by_node.items():
            parts: list[memoryview] = []
            for i in part:
                head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n%b" % (len(keys[i]), keys[i], bulk)
                parts += [memoryview(head), rows[i], CRLF]
            rawio.send_parts(conns[node], parts)
        for node, part in by_node.items():
            replies = memoryview(bytearray(5 * len(part)))
            rawio.recv_parts(conns[node], [replies])
            if bytes(replies) != b"+OK\r\n" * len(part):
                raise RuntimeError(f"unexpected SET replies {bytes(replies[:40])!r}")

    def get_batch(conns: dict[str, socket.socket], batch: list[int]) -> None:
        by_node: dict[str, list[int]] = {}
        for i in batch:
            by_node.setdefault(node_of[i], []).append(i)
        for node, part in by_node.items():
            conns[node].sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(keys[i]), keys[i])
                                         for i in part))
        for node, part in by_node.items():
            heads = [memoryview(bytearray(len(bulk))) for _ in part]
            ends = [memoryview(bytearray(2)) for _ in part]
            parts = [p for n, i in enumerate(part) for p in (heads[n], rows[i], ends[n])]
            rawio.recv_parts(conns[node], parts)
            if any(bytes(h) != bulk for h in heads):
                raise RuntimeError("a GET reply is not a value of the expected size")

    def run(op: Callable[[dict[str, socket.socket], list[int]], None]) -> float:
        def worker(t: int) -> None:
            for batch in rounds[t]:
                op(socks[t], batch)

        return rawio.timed_threads(threads, worker)

    rounds: list[list[list[int]]] = []
    for share in shares:
        if not per_node:
            rounds.append([share[j : j + depth] for j in range(0, len(share), depth)])
            continue
        queues = [[i for i in share if node_of[i] == node] for node in sorted(set(node_of))]
        longest = max(len(q) for q in queues)
        rounds.append([[i for q in queues for i in q[j : j + depth]] for j in range(0, longest, depth)])
    try:
        return {"store_s": run(set_batch), "load_s": run(get_batch)}
    finally:
        for conns in socks:
            for sock in conns.values():
                sock.close()


def _read_line(sock: socket.socket, buf: bytearray) -> bytes:
    """The next RESP line from `sock`, without CRLF; `buf` keeps what was read past it."""
    while (i := buf.find(b"\r\n")) < 0:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("server closed the connection")
        buf += got
    line = bytes(buf[:i])
    del buf[: i + 2]
    return line


def _recv_value(sock: socket.socket, buf: bytearray, row: memoryview) -> None:
    """Read one GET reply whose value fills `row`: its length line, the value straight into `row`
    (recv_into, after whatever `buf` already holds), its CRLF."""
    if _read_line(sock, buf) != b"$%d" % len(row):
        raise RuntimeError("a GET reply is not a value of the expected size")
    have = min(len(buf), len(row))
    row[:have] = buf[:have]
    del buf[:have]
    while have < len(row):
        got = sock.recv_into(row[have:], 0, socket.MSG_WAITALL)
        if not got:
            raise ConnectionError("server closed the connection")
        have += got
    if _read_line(sock, buf) != b"":
        raise RuntimeError("a GET reply did not end where its length said")


def raw_stream(url: str | list[str], value_bytes: int, chunks: int, threads: int,
               depth: int = 0) -> dict[str, float]:
    """Seconds for the streaming raw client (issue 38) to SET then GET `chunks` values: one socket
    per thread (a cluster: per thread and node, each key sent to the node serving its slot); for
    each value a `SET` header, then the row's own memory with `sendall(memoryview)`, then CRLF;
    every reply read after the thread's whole share was sent. Loads the same way: every GET sent,
    then each reply's value read with `recv_into` straight into its row. Rows are distinct slices
    of one pre-touched, page-aligned region. `depth` is unused (the whole share is one batch)."""
    urls = url if isinstance(url, list) else [url]
    node_of = [urls[0]] * chunks
    if isinstance(url, list):
        with redis.Redis.from_url(urls[0]) as admin:
            owners: list[str] = [""] * 16384
            for start, end, master, *_ in admin.execute_command("CLUSTER", "SLOTS"):
                owners[int(start) : int(end) + 1] = [f"redis://127.0.0.1:{int(master[1])}"] * (
                    int(end) + 1 - int(start))
        node_of = [owners[key_slot(b"stream:%d" % i)] for i in range(chunks)]
    shares = [list(range(t, chunks, threads)) for t in range(threads)]
    buf = rawio.rows(chunks, value_bytes)
    rows = [buf[i * value_bytes : (i + 1) * value_bytes] for i in range(chunks)]
    socks = [{node: _resp_connect(node) for node in set(node_of)} for _ in range(threads)]

    def store(t: int) -> None:
        conns = socks[t]
        sent: dict[str, int] = dict.fromkeys(conns, 0)
        for i in shares[t]:
            key = b"stream:%d" % i
            sock = conns[node_of[i]]
            sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(key), key, value_bytes))
            sock.sendall(rows[i])
            sock.sendall(CRLF)
            sent[node_of[i]] += 1
        for node, n in sent.items():
            replies = memoryview(bytearray(5 * n))
            rawio.recv_parts(conns[node], [replies])
            if bytes(replies) != b"+OK\r\n" * n:
                raise RuntimeError(f"unexpected SET replies {bytes(replies[:40])!r}")

    def load(t: int) -> None:
        conns = socks[t]
        asked: dict[str, list[int]] = {node: [] for node in conns}
        for i in shares[t]:
            asked[node_of[i]].append(i)
        for node, part in asked.items():
            conns[node].sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (
                len(k), k) for k in (b"stream:%d" % i for i in part)))
        for node, part in asked.items():
            pending = bytearray()
            for i in part:
                _recv_value(conns[node], pending, rows[i])
            if pending:
                raise RuntimeError("unexpected bytes after the GET replies")

    try:
        return {"store_s": rawio.timed_threads(threads, store), "load_s": rawio.timed_threads(threads, load)}
    finally:
        for conns in socks:
            for sock in conns.values():
                sock.close()


def tier_bench(url: str | list[str], chunk_bytes: int, chunks: int, threads: int,
               tree: str | None = None) -> dict[str, Any]:
    """One `kvtier tier-bench --tier redis` run; with `tree`, of the kvtier source in that folder
    (another checkout: the code before a change, interleaved with the code after it)."""
    where = ["--option", f"urls={json.dumps(url)}"] if isinstance(url, list) else ["--url", url]
    cmd = [sys.executable, "-m", "kvtier.cli", "tier-bench", "--tier", "redis", *where,
           "--chunk-bytes", str(chunk_bytes), "--chunks", str(chunks), "--threads", str(threads),
           "--json"]
    env = None if tree is None else {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tree, env=env)
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="an existing server (default: start a redis-server)")
    p.add_argument("--server", default="redis-server", help="the binary to start (valkey-server)")
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--chunk-bytes", type=int, default=2 << 20)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", help="also write the JSON document here")
    p.add_argument("--cluster", action="store_true",
                   help="start a three-master cluster (valkey-server, else redis-server) instead; "
                        "the raw contenders are resp-cluster and resp-cluster-per-node")
    p.add_argument("--contenders", help="a comma-separated subset of the contenders (default: all)")
    p.add_argument("--before-tree", help="also run the tier from the kvtier source in this folder "
                                         "(`tier-before`: a `git archive` of the commit before a change)")
    args = p.parse_args(argv)

    value_bytes = chunkfmt.HEADER_BYTES + args.chunk_bytes
    depth = -(-DEFAULT_BATCH_BYTES // value_bytes)  # the tier adds values while under batch_bytes
    gib = args.chunk_bytes * args.chunks / 2**30
    deep = -(-args.chunks // args.threads)
    raws: dict[str, tuple[Callable[..., dict[str, float]], int]] = {
        "redis-py": (raw_redis_py, depth), "redis-py-deep": (raw_redis_py, deep),
        "resp": (raw_resp, depth), "resp-deep": (raw_resp, deep),
        "resp-one-buffer": (functools.partial(raw_resp, one_buffer=True), depth),
        "resp-stream": (raw_stream, deep)}
    if args.cluster:
        raws = {"resp-cluster": (raw_resp_cluster, depth),
                "resp-cluster-per-node": (functools.partial(raw_resp_cluster, per_node=True), depth),
                "resp-stream-cluster": (raw_stream, deep)}
    if args.contenders:
        raws = {who: raws[who] for who in args.contenders.split(",") if who in raws}
    contenders = [*raws, "tier", *(["tier-before"] if args.before_tree else [])]
    rows: dict[str, dict[str, list[float]]] = {c: {"store": [], "load": []} for c in contenders}
    loadavg_at_start = os.getloadavg()
    cluster = start_cluster() if args.cluster else None
    server = None if args.url or cluster else start_server(args.server)
    target: str | list[str] = cluster.urls if cluster else (args.url or server.url)  # type: ignore[union-attr]
    admins = [redis.Redis.from_url(u) for u in (target if isinstance(target, list) else [target])]
    try:
        for rep in range(args.repeats):
            shift = rep % len(contenders)
            order = contenders[shift:] + contenders[:shift]
            for who in order:
                for admin in admins:
                    admin.flushall()
                time.sleep(0.2)
                if who in ("tier", "tier-before"):
                    tree = args.before_tree if who == "tier-before" else None
                    r = tier_bench(target, args.chunk_bytes, args.chunks, args.threads, tree)
                else:
                    client, d = raws[who]
                    r = client(target, value_bytes, args.chunks, args.threads, d)
                rows[who]["store"].append(gib / r["store_s"])
                rows[who]["load"].append(gib / r["load_s"])
                print(f"repeat {rep} {who:13s}: store {gib / r['store_s']:.3f} GiB/s, "
                      f"load {gib / r['load_s']:.3f} GiB/s", file=sys.stderr, flush=True)
        for admin in admins:
            admin.flushall()
            admin.close()
    finally:
        if server is not None:
            stop_server(server)
        if cluster is not None:
            cluster.stop()

    med = {who: {ph: statistics.median(v) for ph, v in by.items()} for who, by in rows.items()}
    best = {ph: max(raws, key=lambda who: med[who][ph]) for ph in ("store", "load")}
    doc = {
        "server": "cluster of 3 masters" if cluster else args.url or args.server, "chunks": args.chunks,
        "chunk_bytes": args.chunk_bytes,
        "value_bytes": value_bytes, "threads": args.threads, "raw_pipeline_depth": depth,
        "raw_deep_pipeline_depth": deep, "best_raw": best,
        "repeats": args.repeats, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
        "median_gib_s": med, "all_gib_s": rows,
        "ratio": {ph: med["tier"][ph] / med[best[ph]][ph] for ph in ("store", "load")},
        "spread_gib_s": {who: {ph: [min(v), max(v)] for ph, v in by.items()} for who, by in rows.items()},
        "loadavg_at_start": loadavg_at_start,
    }
    if args.before_tree:
        doc["ratio_before"] = {ph: med["tier-before"][ph] / med[best[ph]][ph] for ph in ("store", "load")}
    if "redis-py" in raws and "redis-py-deep" in raws:
        doc["ratio_vs_redis_py"] = {ph: med["tier"][ph] / max(med["redis-py"][ph], med["redis-py-deep"][ph])
                                    for ph in ("store", "load")}
    print(f"{'':14s} {'store GiB/s':>12s} {'load GiB/s':>12s}  (medians of {args.repeats})")
    for who in contenders:
        print(f"{who:20s} {med[who]['store']:12.3f} {med[who]['load']:12.3f}")
    print(f"{'best raw':14s} {best['store']:>12s} {best['load']:>12s}")
    print(f"{'tier/best raw':14s} {doc['ratio']['store']:12.2f} {doc['ratio']['load']:12.2f}")
    if args.before_tree:
        before = doc["ratio_before"]
        print(f"{'before/best raw':14s} {before['store']:12.2f} {before['load']:12.2f}")
    print(json.dumps(doc))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
