"""p2p tier store and load throughput next to a raw TCP socket copy of the same bytes, in one run.

    python -m benchmarks.bench_p2p --chunks 128 --chunk-bytes 2097152 --threads 4 --repeats 5

Each repeat runs both contenders, in alternating order, over loopback, with the same bytes, the
same number of connections and the same memory footprint:

- raw: a server process and this process each hold `chunks` distinct pre-touched values of
  chunk + 4 KiB (a chunk and its header, what the tier moves per chunk), like the two host
  regions. Load: `threads` connections each ask, in one small request per batch of up to 64
  values (the tier's batch limit), for their share of the values, which the server sends
  back to back from its own rows and the client `recv_into`s its own rows. Store: the same
  bytes the other way (the client sends, the server `recv_into`s and acknowledges each batch).
  No checksums, no headers, no copies beyond the kernel's.
- tier: `kvtier tier-bench --tier p2p --chunk-bytes N --chunks K --threads T --json`: a holder
  peer process serves its host region; a p2p tier process stores (indexes) every chunk of its own
  region, then loads every chunk from the holder into its own region (lookup, authenticated
  connection, header check, checksums on both sides), each job going through the engine-side
  proxy exactly as in serving.

Throughput counts chunk payload bytes (the same for both). Prints a table and a JSON document with
the medians and the ratios tier / raw for store and load.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from kvtier.tiers.common import chunkfmt

BATCH = 64
"""Values per request: the p2p tier's own limit (protocol.MAX_FETCH_KEYS)."""
_REQ = struct.Struct("<4sII")
"""op (b"GET!" or b"PUT!"), first value, count."""


def _rows(count: int, value_bytes: int) -> memoryview:
    """`count` rows of `value_bytes`, pre-touched (like a host region)."""
    buf = np.ones(count * value_bytes, dtype=np.uint8)
    return memoryview(buf).cast("B")


def _recv_exact(conn: socket.socket, out: memoryview) -> None:
    have = 0
    while have < len(out):
        got = conn.recv_into(out[have:])
        if not got:
            raise ConnectionError("peer closed")
        have += got


def _serve(listener: socket.socket, chunks: int, value_bytes: int) -> None:
    rows = _rows(chunks, value_bytes)

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(b"r")  # the rows exist: the client may start its clock
            req = bytearray(_REQ.size)
            while True:
                try:
                    _recv_exact(conn, memoryview(req))
                except ConnectionError:
                    return
                op, first, count = _REQ.unpack(req)
                for v in range(first, first + count):
                    row = rows[v * value_bytes : (v + 1) * value_bytes]
                    if op == b"GET!":
                        conn.sendall(row)
                    else:
                        _recv_exact(conn, row)
                if op == b"PUT!":
                    conn.sendall(b"k")

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def raw_socket_copy(value_bytes: int, chunks: int, threads: int) -> tuple[float, float]:
    """Seconds for `threads` connections to send (store), then receive (load), `chunks` values."""
    listener = socket.create_server(("127.0.0.1", 0))
    server = multiprocessing.get_context("fork").Process(
        target=_serve, args=(listener, chunks, value_bytes), daemon=True)
    server.start()
    try:
        rows = _rows(chunks, value_bytes)
        shares = [list(range(t * chunks // threads, (t + 1) * chunks // threads)) for t in range(threads)]
        conns = [socket.create_connection(listener.getsockname()) for _ in range(threads)]
        for c in conns:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _recv_exact(c, memoryview(bytearray(1)))

        def store(t: int) -> None:
            ack = memoryview(bytearray(1))
            for b in range(0, len(shares[t]), BATCH):
                batch = shares[t][b : b + BATCH]
                conns[t].sendall(_REQ.pack(b"PUT!", batch[0], len(batch)))
                for v in batch:
                    conns[t].sendall(rows[v * value_bytes : (v + 1) * value_bytes])
                _recv_exact(conns[t], ack)

        def load(t: int) -> None:
            for b in range(0, len(shares[t]), BATCH):
                batch = shares[t][b : b + BATCH]
                conns[t].sendall(_REQ.pack(b"GET!", batch[0], len(batch)))
                for v in batch:
                    _recv_exact(conns[t], rows[v * value_bytes : (v + 1) * value_bytes])

        seconds = (_timed(store, threads), _timed(load, threads))
        for c in conns:
            c.close()
        return seconds
    finally:
        server.kill()
        server.join()
        listener.close()


def _timed(work: Callable[[int], None], threads: int) -> float:
    barrier = threading.Barrier(threads + 1)

    def run(t: int) -> None:
        barrier.wait()
        work(t)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    for w in workers:
        w.join()
    return time.perf_counter() - start


def tier_bench(chunk_bytes: int, chunks: int, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "tier-bench", "--tier", "p2p", "--chunk-bytes",
         str(chunk_bytes), "--chunks", str(chunks), "--threads", str(threads), "--json"],
        check=True, capture_output=True, text=True,
    )
    report: dict[str, float] = json.loads(out.stdout)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunk-bytes", type=int, default=2 << 20)
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", help="also write the JSON document here")
    args = p.parse_args()
    gib = args.chunk_bytes * args.chunks / 2**30
    runs: dict[str, list[float]] = {"raw_store": [], "raw_load": [], "tier_store": [], "tier_load": []}
    for r in range(args.repeats):
        order = ("raw", "tier") if r % 2 == 0 else ("tier", "raw")
        for who in order:
            if who == "raw":
                store_s, load_s = raw_socket_copy(args.chunk_bytes + chunkfmt.HEADER_BYTES, args.chunks,
                                                  args.threads)
                runs["raw_store"].append(gib / store_s)
                runs["raw_load"].append(gib / load_s)
            else:
                report = tier_bench(args.chunk_bytes, args.chunks, args.threads)
                runs["tier_store"].append(report["store_gib_s"])
                runs["tier_load"].append(report["load_gib_s"])
        print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in runs.items()) + " GiB/s",
              file=sys.stderr)
    doc: dict[str, object] = {
        "chunk_bytes": args.chunk_bytes, "chunks": args.chunks, "threads": args.threads,
        "repeats": args.repeats, "runs": runs,
    }
    med = {k: statistics.median(v) for k, v in runs.items()}
    doc.update({f"{k}_gib_s": v for k, v in med.items()})
    doc["store_ratio"] = med["tier_store"] / med["raw_store"]
    doc["load_ratio"] = med["tier_load"] / med["raw_load"]
    print(f"{'contender':<10} {'store GiB/s':>12} {'load GiB/s':>11}")
    for who in ("raw", "tier"):
        print(f"{who:<10} {med[who + '_store']:>12.3f} {med[who + '_load']:>11.3f}")
    print(f"tier/raw: store {doc['store_ratio']:.2f}, load {doc['load_ratio']:.2f}")
    print(json.dumps(doc))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f)


if __name__ == "__main__":
    main()
