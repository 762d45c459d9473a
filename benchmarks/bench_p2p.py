"""p2p tier load throughput next to a raw TCP socket copy of the same sizes, in one run.

    python -m benchmarks.bench_p2p --chunks 128 --chunk-bytes 2097152 --threads 4 --repeats 5

Each repeat runs both contenders, in alternating order, over loopback:

- raw: a server process holds one ready-made value of chunk + 4 KiB (the stored chunk format);
  `threads` client threads, each with its own connection, ask for `chunks / threads` values one at a
  time (a 4-byte request, as the tier sends one request per chunk) and `recv_into` a pre-touched
  buffer: no checksums, no copies beyond the kernel's.
- tier: `kvtier tier-bench --tier p2p --chunk-bytes N --chunks K --threads T --json`: a holder
  peer process serves its host region; a p2p tier process loads every chunk into its own host
  region (lookup, authenticated connection, header check, checksum on both sides, the holder's copy
  out of its region before sending).

Prints a table and a JSON document with the medians and the load ratio tier / raw.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import threading
import time

from kvtier.tiers import chunkfmt


def _serve(listener: socket.socket, value_bytes: int) -> None:
    value = bytes(value_bytes)

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while conn.recv(4, socket.MSG_WAITALL) == b"GET!":
                conn.sendall(value)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def raw_socket_copy(value_bytes: int, chunks: int, threads: int) -> float:
    """Seconds for `threads` connections to receive `chunks` values from a server process."""
    listener = socket.create_server(("127.0.0.1", 0))
    server = multiprocessing.get_context("fork").Process(target=_serve, args=(listener, value_bytes),
                                                         daemon=True)
    server.start()
    try:
        shares = [len(range(t, chunks, threads)) for t in range(threads)]
        bufs = [memoryview(bytearray(value_bytes)) for _ in range(threads)]
        conns = [socket.create_connection(listener.getsockname()) for _ in range(threads)]
        for c in conns:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        barrier = threading.Barrier(threads + 1)

        def worker(t: int) -> None:
            barrier.wait()
            for _ in range(shares[t]):
                conns[t].sendall(b"GET!")
                have = 0
                while have < value_bytes:
                    got = conns[t].recv_into(bufs[t][have:])
                    if not got:
                        raise ConnectionError("raw server closed")
                    have += got

        workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        barrier.wait()
        start = time.perf_counter()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
        for c in conns:
            c.close()
        return seconds
    finally:
        server.kill()
        server.join()
        listener.close()


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
    raw: list[float] = []
    tier: list[float] = []
    for r in range(args.repeats):
        order = ("raw", "tier") if r % 2 == 0 else ("tier", "raw")
        for who in order:
            if who == "raw":
                s = raw_socket_copy(args.chunk_bytes + chunkfmt.HEADER_BYTES, args.chunks, args.threads)
                raw.append(gib / s)
            else:
                tier.append(tier_bench(args.chunk_bytes, args.chunks, args.threads)["load_gib_s"])
        print(f"repeat {r}: raw {raw[-1]:.3f} GiB/s, tier {tier[-1]:.3f} GiB/s", file=sys.stderr)
    doc = {
        "chunk_bytes": args.chunk_bytes, "chunks": args.chunks, "threads": args.threads,
        "repeats": args.repeats, "raw_load_gib_s": statistics.median(raw),
        "tier_load_gib_s": statistics.median(tier), "raw_runs": raw, "tier_runs": tier,
    }
    doc["load_ratio"] = doc["tier_load_gib_s"] / doc["raw_load_gib_s"]
    print(f"{'contender':<10} {'load GiB/s':>11}")
    print(f"{'raw':<10} {doc['raw_load_gib_s']:>11.3f}")
    print(f"{'tier':<10} {doc['tier_load_gib_s']:>11.3f}")
    print(f"tier/raw: {doc['load_ratio']:.2f}")
    print(json.dumps(doc))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f)


if __name__ == "__main__":
    main()
