"""The p2p tier: engine instances serve each other's host tier.

What a peer serves: the chunks its own host tier holds. The tier learns them from the cascade: a
STORE job names (key, host slot) pairs while the slots are pinned; the tier computes each row's
checksum then (xxh3-128, the chunk header's), remembers key -> (slot, checksum, the slot's
generation) in a bounded LRU index (`index.ChunkIndex`, `num_slots` entries) and completes the job
at once: nothing is copied. The host tier later evicts and reuses slots without notice, but bumps
a slot's generation (`host.generations`, in the shared region) whenever it hands the slot out
again, so the index is only a claim, checked when a peer asks for a chunk: the slot's generation
is read before the row is sent straight from the region and again after. A reused slot is a miss;
a slot reused while its row was being sent gets an ABORTED trailer after the row, which voids its
bytes (the key is a miss at the requester, which never uses them). A newer STORE naming a slot
also drops whatever key the slot held before. The tier needs a region with slot generations.

Lookups (`lookup.PeerLookup`): keys not known yet answer RETRY and are asked of every peer at once
over ZMQ (DEALER -> ROUTER), in batches; a peer silent for `lookup_timeout_s` counts as holding
nothing; answers (and which peer holds each key) are cached for `lookup_ttl_s`. A LOAD job also
asks at once about its keys whose holder is not known yet; a key it fails to load is forgotten,
so the next lookup asks the peers again.

Loads (`fetch.Fetcher`, `tier.P2PTier._drain_loads`): the keys of all pending LOAD jobs form one
queue; each of `io_threads` load threads takes its share (about 16 MiB of rows at most), asks each
holder for its keys in one data request, and keeps a second request in flight so the holder sends
without pause. Each thread keeps one authenticated TCP connection per holder. The holder answers
the keys back to back (status block, 4 KiB chunk header, row, trailer block: whole 64-byte blocks,
so every row arrives at an aligned offset and the kernel copies it at full speed); the requester
reads the header into a small buffer and checks it, reads the row with `recv_into` straight into
the LOAD job's slot, piece by piece, feeding each piece to a streaming checksum while it is in
cache, and counts the key loaded only when the checksum matches. A holder that dies or stalls mid-row fails
the keys not read yet (a miss: the host tier never publishes a partial row). Data goes over plain
TCP rather than ZMQ frames because ZMQ always receives into its own new buffer, which would add a
copy; sockets use the kernel's timeouts so a piece moves in one system call.

Peers: a static list (`peers`), and/or a redis server (`discovery_url`, `discovery.Discovery`)
where each instance registers its address with a TTL and reads the others'.

Security: every peer holds a shared secret (`secret` or `secret_file`, never sent, logged or
shown in errors). Control messages carry an HMAC-SHA256 over their whole content plus a send time
(a stale one is refused); a data connection starts with a mutual challenge-response over fresh
nonces. Every size, count and key length is checked before use (`protocol`); nothing is unpickled.
A row voided by an ABORTED trailer may carry, in the one piece in flight when the host tier reused
its slot, bytes of the chunk that reused it (the rest of the row goes as zeros): only an
authenticated peer receives them, and its fetcher never uses them (the key fails).
With `curve_secret_key` (or `_file`), the control channel is also ZMQ CURVE: encrypted, and only
peers holding the fleet's CURVE key complete the ZMQ handshake (`curve`). Refusals are counted
(`auth_refused`, `malformed`) and logged once per cause. Without TLS, the data stream after the
handshake is not encrypted or MACed per message: the chunk checksum catches corruption, not an
active attacker on the path (use a trusted network for the data port). With `tls_cert_file`,
`tls_key_file` and `tls_ca_file`, every data connection is mutual TLS under the fleet's CA (`tls`):
encrypted, and refused (`auth_refused`) for a peer without a certificate the CA signed.

Threads (all in the tier process): the dispatch thread only queues work; `io_threads` load threads
plus one store thread (two `IoPool`s); one lookup thread (owns the DEALER sockets); one control
thread (owns the ROUTER); one ZAP thread with CURVE; one accept thread (which also ends handshakes
past their deadline) and one thread per served connection (`max_handshakes` authenticating,
`max_connections` authenticated: `row_server`); one discovery thread when configured. Failures
are values: a key that could not be loaded fails its job; no exception crosses the tier contract.
"""

from kvtier.tiers.p2p.tier import P2PTier

__all__ = ["P2PTier"]
