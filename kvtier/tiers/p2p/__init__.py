"""The p2p tier: engine instances serve each other's host tier.

What a peer serves: the chunks its own host tier holds. The tier learns them from the cascade: a
STORE job names (key, host slot) pairs while the slots are pinned; the tier computes each row's
checksum then, remembers key -> (slot, checksum) in a bounded LRU index (`index.ChunkIndex`,
`num_slots` entries) and completes the job at once: nothing is copied. The host tier later evicts
and reuses slots without notice, so the index is only a claim: when a peer asks for a chunk, the
row is copied out of the region into a per-connection send buffer and sent only if the copy still
has the remembered checksum; otherwise the key is forgotten and the answer is "miss". A newer STORE
naming a slot also drops whatever key the slot held before.

Lookups (`lookup.PeerLookup`): keys not known yet answer RETRY and are asked of every peer at once
over ZMQ (DEALER -> ROUTER), in batches; a peer silent for `lookup_timeout_s` counts as holding
nothing; answers (and which peer holds each key) are cached for `lookup_ttl_s`.

Loads (`fetch.Fetcher`): each I/O thread keeps one authenticated TCP connection per holder. The
holder sends a status byte, the 4 KiB chunk header and the row; the requester reads the header into
a small buffer and checks it, reads the row with `recv_into` straight into the LOAD job's slot, and
verifies the checksum there before the key counts as loaded. A holder that dies or stalls mid-row
fails the key (a miss: the host tier never publishes the partial row). Data goes over plain TCP
rather than ZMQ frames because ZMQ always receives into its own new buffer, which would add a copy.

Peers: a static list (`peers`), and/or a redis server (`discovery_url`, `discovery.Discovery`)
where each instance registers its address with a TTL and reads the others'.

Security: every peer holds a shared secret (`secret` or `secret_file`, never sent, logged or
shown in errors). Control messages carry an HMAC-SHA256 over their whole content plus a send time
(a stale one is refused); a data connection starts with a mutual challenge-response over fresh
nonces. Every size, count and key length is checked before use (`protocol`); nothing is unpickled.
Refusals are counted (`auth_refused`, `malformed`) and logged once per cause. After the handshake
the data stream is not encrypted or MACed per message: the chunk checksum catches corruption, not
an active attacker on the path (use a trusted network; ZMQ CURVE / TLS are not implemented yet).

Threads (all in the tier process): the dispatch thread only queues work; `io_threads` load threads
plus one store thread (`IoPool`); one lookup thread (owns the DEALER sockets); one control thread
(owns the ROUTER); one accept thread and one thread per served connection (`max_connections`);
one discovery thread when configured. Failures are values: a key that could not be loaded fails
its job; no exception crosses the tier contract.
"""

from kvtier.tiers.p2p.tier import P2PTier

__all__ = ["P2PTier"]
