"""p2p tier loads next to a raw TCP copy of the same rows, and its stores next to the same checksums.

    python -m benchmarks.bench_p2p --chunks 128 --chunk-bytes 2097152 --threads 4 --repeats 7

Each repeat runs every contender, in rotating order, over loopback, with the same rows (`chunks`
distinct pre-touched rows of `chunk-bytes` in one process, copied into distinct pre-touched rows of
as large a buffer in another: the memory footprint of two host regions), the same number of
connections and threads:

- raw (`raw_load`): a server process and this process, `threads` connections, each thread asking
  for its share of the rows with one 4-byte request per row (the next request sent before the
  current row is read, so the server never waits for it), the server answering with one `sendall`
  of the row, the client reading it with one `recv_into` (MSG_WAITALL) into its row. Nothing else:
  no header, no checksum, no lookup. Rows are page-aligned on both sides, like host regions.
  `--raw-variants` also runs weaker raw copies (rows where numpy puts them, 16 bytes into a page; a
  plain `recv_into` loop; one request per batch of up to 64 rows; all three: the raw copy measured
  before) that explain why raw baselines measured here differed.
- hash (`hash_store`): what a p2p STORE computes, bare: the row's xxh3-128 (`chunkfmt.checksum`),
  one thread, over the same rows. A p2p store moves no bytes; this
  is the like-for-like reference for it.
- tier: `kvtier tier-bench --tier p2p --json` (a holder peer process serving its host region; a p2p
  tier process loading into its own, each job through the engine-side proxy as in serving): its
  store (index + checksums), its load alone (lookups settled first) and its load with its lookups
  (timed from the first lookup answered RETRY), after an untimed warm-up that opens the
  connections (the raw copy's are open before its timer too). It runs once per `--keys-per-job`
  value, each repeat: loads of one chunk per job (`tier_load`: 128 jobs through the proxy and the
  tier's dispatch thread, the per-job cost at its highest) and of N chunks per job
  (`tier_load_jobsN`: as the manager submits a promotion, one job per tier for the request's run).

`--before-tree DIR` also runs tier-bench from the kvtier source in DIR (a `git archive` of the
commit before a change) in the same rotation: its results are named `before_*`.

Throughput counts row bytes. Prints per-repeat values, a table of medians with min-max spreads, the
ratios tier / raw (loads) and tier / hash (stores), and a JSON document.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

from benchmarks import rawio
from kvtier.tiers.common import chunkfmt

BATCH = 64
"""Rows per request in the batched raw variant: the p2p tier's own limit (MAX_FETCH_KEYS)."""
_REQ = struct.Struct("<II")
"""First row, count (the per-row variants ask for one row: count 1)."""


def _recv_row(conn: socket.socket, out: memoryview, waitall: bool) -> None:
    have = 0
    while have < len(out):
        got = conn.recv_into(out[have:], 0, socket.MSG_WAITALL if waitall else 0)
        if not got:
            raise ConnectionError("peer closed")
        have += got


def _serve(listener: socket.socket, chunks: int, row_bytes: int, offset: int) -> None:
    rows = rawio.rows(chunks, row_bytes, offset)

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            req = memoryview(bytearray(_REQ.size))
            while True:
                try:
                    _recv_row(conn, req, True)
                except ConnectionError:
                    return
                first, count = _REQ.unpack(req)
                for v in range(first, first + count):
                    conn.sendall(rows[v * row_bytes : (v + 1) * row_bytes])

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


class RawCopy:
    """A server process holding `chunks` rows and `threads` open connections to it; the rows of
    both sides start `offset` bytes into their pages."""

    def __init__(self, chunks: int, row_bytes: int, threads: int, offset: int = 0) -> None:
        self.chunks, self.row_bytes, self.threads = chunks, row_bytes, threads
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.server = multiprocessing.get_context("fork").Process(
            target=_serve, args=(self.listener, chunks, row_bytes, offset), daemon=True)
        self.server.start()
        self.rows = rawio.rows(chunks, row_bytes, offset)
        self.conns = [socket.create_connection(self.listener.getsockname()) for _ in range(threads)]
        for c in self.conns:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def load(self, waitall: bool, per_row: bool) -> float:
        """Seconds for every thread to receive its share of the rows into its own rows."""
        n, size = self.chunks, self.row_bytes

        def work(t: int) -> None:
            share = list(range(t * n // self.threads, (t + 1) * n // self.threads))
            conn = self.conns[t]
            asks = [(v, 1) for v in share] if per_row else [
                (share[b], len(share[b : b + BATCH])) for b in range(0, len(share), BATCH)]
            conn.sendall(_REQ.pack(*asks[0]))
            for i, v in enumerate(share):
                if per_row and i + 1 < len(share):
                    conn.sendall(_REQ.pack(*asks[i + 1]))
                elif not per_row and i % BATCH == 0 and i // BATCH + 1 < len(asks):
                    conn.sendall(_REQ.pack(*asks[i // BATCH + 1]))
                _recv_row(conn, self.rows[v * size : (v + 1) * size], waitall)

        return rawio.timed_threads(self.threads, work)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.server.kill()
        self.server.join()
        self.listener.close()


def hash_store(rows: memoryview, chunks: int, row_bytes: int) -> float:
    """Seconds for one thread to compute what a p2p STORE computes for every row."""
    start = time.perf_counter()
    for v in range(chunks):
        chunkfmt.checksum(rows[v * row_bytes : (v + 1) * row_bytes])
    return time.perf_counter() - start


def tier_bench(chunk_bytes: int, chunks: int, threads: int, keys_per_job: int,
               failures: list[str], tree: str | None = None) -> dict[str, float]:
    """One `kvtier tier-bench --tier p2p` run (with `tree`, of the kvtier source in that folder); a
    run that fails (e.g. a lookup timed out on a loaded machine) is recorded in `failures` (its
    last error line) and run again, up to 3 times."""
    env = None if tree is None else {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "tier-bench", "--tier", "p2p", "--chunk-bytes",
             str(chunk_bytes), "--chunks", str(chunks), "--threads", str(threads),
             "--keys-per-job", str(keys_per_job), "--json"],
            capture_output=True, text=True, cwd=tree, env=env,
        )
        if out.returncode == 0:
            report: dict[str, float] = json.loads(out.stdout)
            return report
        failures.append((out.stderr.strip().splitlines() or ["no output"])[-1])
        print(f"tier-bench failed: {failures[-1]}", file=sys.stderr)
    raise RuntimeError("tier-bench failed 3 times in a row")


RAW_VARIANTS = {"raw_load": (0, True, True), "raw_load_numpy_rows": (16, True, True),
                "raw_load_plain_recv": (0, False, True), "raw_load_batched": (0, True, False),
                "raw_load_as_before": (16, False, False)}
"""Raw contenders: (rows' offset into their pages, recv with MSG_WAITALL, one request per row).
`raw_load_as_before` is the raw copy BENCHMARKS.md measured before: numpy rows, a plain recv_into
loop, one request per batch."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunk-bytes", type=int, default=2 << 20)
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--keys-per-job", default="1,16",
                   help="comma-separated chunks per tier LOAD job, one tier run per value (default 1,16)")
    p.add_argument("--raw-variants", action="store_true", help="also run the weaker raw copies")
    p.add_argument("--no-tier", action="store_true", help="raw contenders only")
    p.add_argument("--before-tree", help="also run the tier from the kvtier source in this folder "
                                         "(`before_*`: a `git archive` of the commit before a change)")
    p.add_argument("--json-out", help="also write the JSON document here")
    args = p.parse_args()
    try:
        per_job = [int(v) for v in args.keys_per_job.split(",")]
    except ValueError:
        p.error(f"--keys-per-job {args.keys_per_job!r}: expected comma-separated integers")
    if not per_job or min(per_job) < 1:
        p.error(f"--keys-per-job {args.keys_per_job!r}: every value must be >= 1")
    gib = args.chunk_bytes * args.chunks / 2**30
    raws = list(RAW_VARIANTS) if args.raw_variants else ["raw_load"]
    tiers = [] if args.no_tier else [f"tier{n}" for n in per_job]
    tiers += [f"before{n}" for n in per_job] if args.before_tree and not args.no_tier else []
    contenders = [*raws, "hash_store", *tiers]
    runs: dict[str, list[float]] = {}
    failures: list[str] = []
    copies = {offset: RawCopy(args.chunks, args.chunk_bytes, args.threads, offset)
              for offset in sorted({RAW_VARIANTS[who][0] for who in raws})}
    loadavg = [os.getloadavg()[0]]
    try:
        for r in range(args.repeats):
            shift = r % len(contenders)
            for who in contenders[shift:] + contenders[:shift]:
                if who in RAW_VARIANTS:
                    offset, waitall, per_row = RAW_VARIANTS[who]
                    runs.setdefault(who, []).append(gib / copies[offset].load(waitall, per_row))
                elif who == "hash_store":
                    rows = copies[0].rows
                    runs.setdefault(who, []).append(gib / hash_store(rows, args.chunks, args.chunk_bytes))
                else:
                    kind = "before" if who.startswith("before") else "tier"
                    n = int(who.removeprefix(kind))
                    report = tier_bench(args.chunk_bytes, args.chunks, args.threads, n, failures,
                                        args.before_tree if kind == "before" else None)
                    loads = {f"{kind}_{name}" + ("" if n == 1 else f"_jobs{n}"): report[f"{name}_gib_s"]
                             for name in ("load", "load_lookups")}
                    if n == per_job[0]:
                        loads[f"{kind}_store"] = report["store_gib_s"]
                        loads[f"{kind}_lookup_ms"] = report["lookup_s"] * 1e3
                    for name, value in loads.items():
                        runs.setdefault(name, []).append(value)
            loadavg.append(os.getloadavg()[0])
            print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()), file=sys.stderr)
    finally:
        for raw in copies.values():
            raw.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    doc: dict[str, object] = {
        "chunk_bytes": args.chunk_bytes, "chunks": args.chunks, "threads": args.threads,
        "keys_per_job": per_job,
        "repeats": args.repeats, "loadavg": [min(loadavg), max(loadavg)], "runs": runs,
        "median": med, "spread": {k: [min(v), max(v)] for k, v in runs.items()},
        "tier_failed_runs": failures,
    }
    ratios = {} if args.no_tier else {
        **{name.removeprefix("tier_") + "_vs_raw": med[name] / med["raw_load"]
           for name in med if name.startswith(("tier_load", "before_load"))},
        "store_vs_hash": med["tier_store"] / med["hash_store"]}
    doc["ratios"] = ratios
    print(f"{'GiB/s (tier_lookup_ms: ms)':<28} {'median':>7} {'min':>7} {'max':>7}")
    for k, v in runs.items():
        print(f"{k:<28} {med[k]:>7.2f} {min(v):>7.2f} {max(v):>7.2f}")
    for k, ratio in ratios.items():
        print(f"{k}: {ratio:.2f}")
    print(json.dumps(doc))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
