"""Real vLLM (CPU, float32, in-process) with chunks of two blocks, a small host tier and an fs tier:
partial hits, corrupted and killed fs tiers, a restart in a new process, metrics and KV events by
value, and configurations vLLM must refuse with kvtier's message.

float32 (about 5x faster than bf16 on these CPUs) is in the layout fingerprint, so its chunks never
mix with bf16 ones. Outputs are compared as in `test_vllm_reload.py`: a reload against vLLM's own
device prefix cache at the same hit length, a recompute against a recompute.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.common import chunkfmt
from tests.conftest import wait_until
from tests.integrations.conftest import BLOCK_SIZE, connector_halves, run_child
from tests.integrations.dynamo_indexer import NOTHING, Indexer, require_indexer
from tests.integrations.engine_steps import evict_host, generate
from tests.integrations.kv_event_helpers import (
    assert_names_device_blocks,
    decoded,
    promote,
    sidecar_blocks,
    stored_by_medium,
    tick,
)
from tests.integrations.prompts import PROMPTS
from tests.integrations.serve_helpers import free_port
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

BPC = 2
CHUNK = BLOCK_SIZE * BPC
ROW_BYTES = 30 * 2 * 3 * CHUNK * 64 * 4  # SmolLM2: 30 layers, 3 KV heads, head_dim 64, float32
HOST_SLOTS = 4  # two prompts of 2 chunks
LLM_ARGS = {"dtype": "float32", "enforce_eager": True, "block_size": BLOCK_SIZE,
            "num_gpu_blocks_override": 64, "kv_cache_memory_bytes": 64 << 20,
            "max_model_len": 1024, "max_num_seqs": 4, "seed": 0}


def fleet_key_file(fs_dir: Path) -> Path:
    """A private fleet key beside `fs_dir`, made once: the module's engines MAC their chunks."""
    path = fs_dir.with_name(fs_dir.name + ".key")
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
    return path


def extra_config(fs_dir: Path) -> dict[str, Any]:
    return {"cpu_bytes_to_use": HOST_SLOTS * ROW_BYTES, "blocks_per_chunk": BPC,
            "tier_restart_backoff_s": 0.2, "fleet_key_file": str(fleet_key_file(fs_dir)),
            "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]}


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], fs_dir: Path) -> Any:
    """The engine; it publishes its KV events on ZMQ at `llm.test_endpoint` and keeps each batch
    in `llm.test_events` too."""
    from vllm.config import KVEventsConfig

    port = free_port()  # vLLM binds a wildcard endpoint (else it connects), a router connects
    llm = make_llm(extra_config(fs_dir), dtype="float32", kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}"))
    published: list[Any] = []
    publisher = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
    send = publisher.publish

    def publish(batch: Any) -> None:
        published.append(batch)
        send(batch)

    publisher.publish = publish
    llm.test_events, llm.test_endpoint = published, f"tcp://127.0.0.1:{port}"
    return llm


def tokens(llm: Any, name: str) -> list[int]:
    """The prompt's token ids cut to whole chunks plus one token, so vLLM's own device hit (whole
    blocks) and kvtier's (whole chunks) have the same length."""
    ids: list[int] = llm.get_tokenizer().encode(PROMPTS[name])
    return ids[: (len(ids) - 1) // CHUNK * CHUNK + 1]



def kv_events(llm: Any) -> list[Any]:
    """Every event published since the last call (kvtier's and vLLM's), read with vLLM's decoder."""
    batches, llm.test_events[:] = list(llm.test_events), []
    return decoded(batches)


def test_chunks_of_two_blocks_reload_from_host_with_split_metrics_and_events(llm: Any) -> None:
    scheduler, _ = connector_halves(llm)
    metrics = scheduler.accounting.metrics
    prompt = tokens(llm, "lighthouse")
    hit = (len(prompt) - 1) // CHUNK * CHUNK
    keys = scheduler.hasher.keys(prompt)[: hit // CHUNK]
    kv_events(llm)
    first = generate(llm, prompt)
    assert first.kv_transfer_params["kvtier"]["tokens"] == {
        "device": 0, "host": 0, "fs": 0, "recomputed": len(prompt)}
    settle(scheduler)
    ref = generate(llm, prompt)
    assert ref.num_cached_tokens == hit
    assert ref.kv_transfer_params["kvtier"]["tokens"]["device"] == hit
    stores0 = metrics.value("kvtier_transfer_chunks_total", tier="host", op="load")

    assert llm.reset_prefix_cache()
    again = generate(llm, prompt)

    assert again.num_cached_tokens == hit
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids
    assert again.kv_transfer_params["kvtier"]["tokens"] == {
        "device": 0, "host": hit, "fs": 0, "recomputed": len(prompt) - hit}
    assert list(scheduler.accounting.finished.values())[-1]["host"] == hit  # by engine request id
    m = metrics.value
    assert m("kvtier_transfer_chunks_total", tier="host", op="load") - stores0 == len(keys)
    assert m("kvtier_transfer_bytes_total", tier="host", op="store") >= len(keys) * ROW_BYTES
    assert m("kvtier_transfer_chunks_total", tier="fs", op="store") >= len(keys)
    assert m("kvtier_prompt_tokens_total", source="host") >= hit
    assert m("kvtier_used_bytes", tier="host") == m("kvtier_used_chunks", tier="host") * ROW_BYTES
    settle(scheduler)
    tick(llm)
    stored = stored_by_medium(kv_events(llm))
    device = [h for e in stored["GPU"] for h in e.block_hashes]  # vLLM's own, in the same stream
    assert len(device) >= hit // BLOCK_SIZE
    for medium in ("CPU", "STORAGE"):  # host, then fs: vLLM's hash of each engine block
        assert [h for e in stored[medium] for h in e.block_hashes] == device[: hit // BLOCK_SIZE]
        for event in stored[medium]:
            assert_names_device_blocks(event, device, prompt)
    for i, key in enumerate(keys):  # what names the fs copies after a restart: a sidecar per chunk
        blocks = sidecar_blocks(scheduler, "fs", key)
        assert blocks is not None and blocks.tokens.tolist() == prompt[i * CHUNK : (i + 1) * CHUNK]
        assert [int.from_bytes(h[-8:], "big") for h in blocks.hashes] == device[i * BPC : (i + 1) * BPC]


def test_partial_prefix_hit_matches_the_device_prefix_cache(llm: Any) -> None:
    scheduler, _ = connector_halves(llm)
    base = tokens(llm, "bread")
    generate(llm, base, max_tokens=1)
    settle(scheduler)
    prompt = base[:CHUNK] + tokens(llm, "garden")[:CHUNK + 1]
    ref = generate(llm, prompt, skip_store=True)  # device hit: the first chunk of `base`
    assert ref.num_cached_tokens == CHUNK

    assert llm.reset_prefix_cache()
    again = generate(llm, prompt, skip_store=True)

    assert again.num_cached_tokens == CHUNK
    assert again.kv_transfer_params["kvtier"]["tokens"] == {
        "device": 0, "host": CHUNK, "fs": 0, "recomputed": len(prompt) - CHUNK}
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids


def salted(llm: Any, prompt: list[int], tenant: str, max_tokens: int = 4) -> Any:
    """`prompt` served for `tenant` (its `cache_salt`); then its tier jobs finish."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = llm.generate([{"prompt_token_ids": prompt, "cache_salt": tenant}], params,
                       use_tqdm=False)[0]
    settle(connector_halves(llm)[0])
    return out


def split_of(out: Any) -> dict[str, int]:
    return dict(out.kv_transfer_params["kvtier"]["tokens"])


@pytest.mark.parametrize("tier", ["host", "fs"])
def test_tenants_never_reuse_each_others_chunks(llm: Any, tier: str) -> None:
    """Alice's chunks of a prompt sit in the host tier (and in fs, the host tier emptied for the fs
    case); Bob sends the identical prompt with another `cache_salt`: he reuses nothing, and gets
    the answer of a full compute. Alice, asking again, reuses them from that tier (the control)."""
    scheduler, _ = connector_halves(llm)
    prompt = tokens(llm, "library")
    alice, bob = f"alice-{tier}", f"bob-{tier}"
    hit = (len(prompt) - 1) // CHUNK * CHUNK
    computed = salted(llm, prompt, alice)
    assert computed.num_cached_tokens == 0

    assert llm.reset_prefix_cache()  # the device cache would not serve Bob either; out of the way
    if tier == "fs":
        assert scheduler.reset_cache()
    theirs = salted(llm, prompt, bob)

    assert theirs.num_cached_tokens == 0
    assert split_of(theirs) == {"device": 0, "host": 0, "fs": 0, "recomputed": len(prompt)}
    assert theirs.outputs[0].token_ids == computed.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    if tier == "fs":
        assert scheduler.reset_cache()
    again = salted(llm, prompt, alice)
    assert split_of(again) == {"device": 0, "host": 0, "fs": 0, **{tier: hit},
                               "recomputed": len(prompt) - hit}


def test_corrupted_and_forged_fs_files_are_recomputed_and_counted(llm: Any, fs_dir: Path) -> None:
    scheduler, _ = connector_halves(llm)
    prompt = tokens(llm, "garden")
    keys = scheduler.hasher.keys(prompt)
    computed = generate(llm, prompt)
    assert computed.num_cached_tokens == 0
    evict_host(llm, keys, lambda name: tokens(llm, name))
    files = [p for p in fs_dir.glob("*/*/*") if any(k.hex() == p.name for k in keys)]  # chunks only
    assert len(files) == len(keys)
    head = chunkfmt.HEADER_BYTES
    for path in files[1:]:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    # A forgery by whoever can write the directory but holds no fleet key: other bytes under the
    # chunk's key, with a correct header and checksum.
    data = files[0].read_bytes()
    key, fingerprint, _ = chunkfmt.header_fields(data[:head])
    payload = bytearray(data[head:])
    payload[len(payload) // 2] ^= 0xFF
    files[0].write_bytes(chunkfmt.header_bytes(key, fingerprint, payload) + payload)
    failures = scheduler.accounting.metrics.value("kvtier_failures_total", tier="fs", op="load")
    forged = scheduler.accounting.metrics.value("kvtier_bad_chunks_total", tier="fs", reason="mac")

    assert llm.reset_prefix_cache()
    again = generate(llm, prompt)

    assert again.num_cached_tokens == 0
    assert again.kv_transfer_params["kvtier"]["tokens"]["recomputed"] == len(prompt)
    assert again.outputs[0].token_ids == computed.outputs[0].token_ids
    after = scheduler.accounting.metrics.value("kvtier_failures_total", tier="fs", op="load")
    assert after - failures >= 1

    def counted() -> bool:
        scheduler.manager.poll()  # the tier's counts arrive with its reports
        return scheduler.accounting.metrics.value("kvtier_bad_chunks_total", tier="fs", reason="mac") > forged

    wait_until(counted, "the forged chunk counted as a bad MAC")


def test_killed_fs_tier_process_requests_complete(llm: Any) -> None:
    scheduler, _ = connector_halves(llm)
    prompt = tokens(llm, "chess")
    computed = generate(llm, prompt)
    settle(scheduler)
    fs = scheduler.manager.tiers["fs"]
    restarts = fs.restarts
    assert scheduler.reset_cache() and llm.reset_prefix_cache()
    os.kill(fs._gen.proc.pid, signal.SIGKILL)

    outs = [generate(llm, prompt), generate(llm, tokens(llm, "railway"), max_tokens=2)]

    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 2]
    assert outs[0].outputs[0].token_ids == computed.outputs[0].token_ids
    deadline = time.monotonic() + 20
    while fs.restarts == restarts or not fs.is_up:
        assert time.monotonic() < deadline, "the fs tier was not restarted"
        time.sleep(0.05)
        scheduler.manager.poll()


def test_fs_chunks_reload_in_a_new_process(llm: Any, fs_dir: Path) -> None:
    scheduler, _ = connector_halves(llm)
    prompt = tokens(llm, "birds")
    generate(llm, prompt, max_tokens=1)
    settle(scheduler)
    ref = generate(llm, prompt)
    hit = (len(prompt) - 1) // CHUNK * CHUNK
    assert ref.num_cached_tokens == hit

    (run,) = run_child({"extra_configs": [extra_config(fs_dir)], "llm": LLM_ARGS,
                        "prompts": [prompt], "max_tokens": 6})

    (result,) = run["results"]
    assert result["cached"] == hit
    assert result["kvtier"]["tokens"] == {"device": 0, "host": 0, "fs": hit,
                                          "recomputed": len(prompt) - hit}
    assert result["tokens"] == list(ref.outputs[0].token_ids)


def test_a_prefix_longer_than_the_host_tier_streams_back_from_fs(llm: Any) -> None:
    """Seven chunks in the fs tier, room for four in the host tier: the whole prefix comes back
    (promoted and copied a batch at a time), not only the four that fit at once."""
    scheduler, _ = connector_halves(llm)
    metrics = scheduler.accounting.metrics
    text = " ".join(["Four stories, one after the other."] +
                    [PROMPTS[n] for n in ("railway", "chess", "library", "garden")])
    ids: list[int] = llm.get_tokenizer().encode(text)
    prompt = ids[: 7 * CHUNK + 1]
    keys = scheduler.hasher.keys(prompt)
    assert len(keys) == 7 > HOST_SLOTS
    generate(llm, prompt, max_tokens=16)  # decode steps give the chunks without room theirs
    settle(scheduler)
    fs = scheduler.manager.tiers["fs"]
    deadline = time.monotonic() + 20
    while (answers := fs.lookup(keys)).count(answers[0]) < len(keys) or answers[0].name == "RETRY":
        assert time.monotonic() < deadline, answers
        time.sleep(0.02)
    assert answers[0].name == "HIT", answers
    ref = generate(llm, prompt)
    assert ref.num_cached_tokens == 7 * CHUNK
    loads = metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load")

    assert scheduler.reset_cache() and llm.reset_prefix_cache()
    again = generate(llm, prompt)

    assert again.num_cached_tokens == 7 * CHUNK
    assert again.kv_transfer_params["kvtier"]["tokens"] == {
        "device": 0, "host": 0, "fs": 7 * CHUNK, "recomputed": 1}
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids
    assert metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load") - loads == 7
    assert not scheduler.streams and not scheduler._loading
    settle(scheduler)
    assert all(scheduler.manager.host.pin_count(k) == 0 for k in keys)
    scheduler.manager.host.check()


def test_a_host_run_continues_the_device_prefix_vllm_announced(llm: Any) -> None:
    """Two prompts share their first chunk: the second's device hit covers it, kvtier stores only
    its second chunk, and that event's parent is the device block vLLM named before it."""
    ids: list[int] = llm.get_tokenizer().encode("Two prompts, one beginning. " + PROMPTS["railway"])
    first = ids[: 2 * CHUNK + 1]
    second = first[:CHUNK] + tokens(llm, "chess")[: CHUNK + 1]
    kv_events(llm)
    generate(llm, first, max_tokens=1)
    generate(llm, second, max_tokens=1)
    settle(connector_halves(llm)[0])
    tick(llm)
    stored = stored_by_medium(kv_events(llm))
    head = next(e for e in stored["GPU"] if e.token_ids[:BLOCK_SIZE] == first[:BLOCK_SIZE])
    branch = next(e for e in stored["GPU"] if e.parent_block_hash == head.block_hashes[BPC - 1]
                  and e.token_ids[:BLOCK_SIZE] == second[CHUNK : CHUNK + BLOCK_SIZE])
    device = [*head.block_hashes[:BPC], *branch.block_hashes]
    (run,) = [e for e in stored["CPU"] if e.parent_block_hash == device[BPC - 1]]
    assert run.block_hashes == device[BPC : 2 * BPC]
    assert_names_device_blocks(run, device, second)


def test_dynamos_indexer_sees_a_prefix_leave_device_host_then_disk(llm: Any, fs_dir: Path,
                                                                   tmp_path: Path) -> None:
    """NVIDIA Dynamo's KV indexer, subscribed to the engine's ZMQ events, reports the prompt on the
    device, then in host memory once the device evicted it, then on disk once only fs holds it,
    then nowhere once kvtier dropped it (a corrupt file found on promotion)."""
    require_indexer()
    scheduler, _ = connector_halves(llm)
    ids: list[int] = llm.get_tokenizer().encode("Which instance holds this? " + PROMPTS["library"])
    prompt, hit = ids[: 2 * CHUNK + 1], 2 * CHUNK
    held, keys = prompt[:hit], scheduler.hasher.keys(prompt)[:2]
    indexer = Indexer(llm.test_endpoint, BLOCK_SIZE, free_port(), tmp_path / "indexer.log")
    try:
        for i in range(10):  # the indexer misses the first batch after it connects
            warm = list(range(500 + 40 * i, 540 + 40 * i))  # one full block
            generate(llm, warm, max_tokens=1, skip_store=True)
            if indexer.reaches(warm[:BLOCK_SIZE], {"gpu": BLOCK_SIZE, "cpu": BLOCK_SIZE,
                                                   "disk": BLOCK_SIZE}, timeout_s=0.5):
                break
        generate(llm, prompt, max_tokens=1)
        settle(scheduler)
        tick(llm)
        indexer.wait_for(held, {"gpu": hit, "cpu": hit, "disk": hit})  # vLLM's own events arrive
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        pool.evict_blocks(set(range(len(pool.blocks))))  # vLLM's eviction: a BlockRemoved each
        tick(llm)
        indexer.wait_for(held, {"gpu": 0, "cpu": hit, "disk": hit})
        assert scheduler.reset_cache()
        tick(llm)
        indexer.wait_for(held, {"gpu": 0, "cpu": 0, "disk": hit})
        for path in fs_dir.glob("*/*/*"):  # the chunk files (not their sidecars)
            if any(k.hex() == path.name for k in keys):
                path.write_bytes(b"\0" * path.stat().st_size)
        promote(scheduler, keys)
        tick(llm)
        indexer.wait_for(held, NOTHING)
    finally:
        indexer.close()

