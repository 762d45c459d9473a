"""Real vLLM instances (CPU, float32) sharing KV through the obj, redis and p2p tiers.

Instance A runs in a child process that stays up (`shared_helpers.EngineProcess`): it computes the
prompts, and its chunks cascade to a SeaweedFS bucket, a redis-server namespace and its p2p tier,
which serves A's host tier on a loopback port. Instance B is this process's engine, configured with
the same bucket, namespace and secret, and A as its static p2p peer; it never computed those
prompts. Each of B's requests names the one tier allowed to serve it (`load_tiers`), so the
per-request split shows which tier the chunks came from. B also has a second p2p tier with a wrong
secret (`intruder`): A refuses it, and B recomputes what it asked for.

Output oracle (as in `test_vllm_reload.py`): a prompt B reloads must give the greedy tokens A gave
for it from its own device prefix cache at the same hit length (A's second request for the prompt);
a prompt recomputed because its load failed must give the tokens of a full compute (A's, or B's own
first request). Outputs of two processes are comparable: same model, dtype, shapes and kernels.

The SeaweedFS server is this module's own, since one test SIGKILLs and restarts it.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.host.region import remove_stale_regions
from kvtier.ops.metrics import TierCounter
from tests.integrations.conftest import BLOCK_SIZE, _model_path, connector_halves
from tests.integrations.prompts import PROMPTS
from tests.integrations.shared_helpers import EngineProcess, result_of, settle
from tests.services.redis_server import RedisServer, free_port, fresh_prefix
from tests.services.s3 import SeaweedServer, running_seaweed

pytestmark = pytest.mark.slow

CHUNK = BLOCK_SIZE  # blocks_per_chunk = 1
ROW_BYTES = 30 * 2 * 3 * CHUNK * 64 * 4  # SmolLM2: 30 layers, 3 KV heads, head_dim 64, float32
MAX_TOKENS = 4
SECRET = secrets.token_hex(16)
LLM_ARGS = {"dtype": "float32", "enforce_eager": True, "block_size": BLOCK_SIZE,
            "num_gpu_blocks_override": 64, "kv_cache_memory_bytes": 64 << 20,
            "max_model_len": 1024, "max_num_seqs": 4, "seed": 0}
RELOADED = {"obj": "lighthouse", "redis": "bread", "p2p": "library"}
"""The prompt each tier serves to B: A computes it, B reloads it from that tier only."""
RECOMPUTED = {"auth": "birds", "kill": "chess"}
"""Prompts A computes once, that B must recompute (its load is refused or fails)."""


def cut(ids: list[int]) -> list[int]:
    """Whole chunks plus one token, so vLLM's device hit (whole blocks) and kvtier's (whole
    chunks) have the same length."""
    return ids[: (len(ids) - 1) // CHUNK * CHUNK + 1]


def hit_of(prompt: list[int]) -> int:
    return (len(prompt) - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_model_path()))
    return {name: cut(tokenizer.encode(text)) for name, text in PROMPTS.items()}


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    with running_seaweed(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def shared_tiers(seaweed: SeaweedServer, redis_server: RedisServer) -> list[dict[str, Any]]:
    """The obj and redis tiers every instance of this module shares (a fresh bucket and prefix)."""
    return [{"type": "obj", **seaweed.bucket_options(seaweed.new_bucket()), "connect_timeout_s": 1.0,
             "read_timeout_s": 3.0},
            {"type": "redis", "url": redis_server.url, "key_prefix": fresh_prefix()}]


def config(host_slots: int, tiers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"cpu_bytes_to_use": host_slots * ROW_BYTES, "tier_restart_backoff_s": 0.2,
            "secondary_tiers": tiers}


@pytest.fixture(scope="module")
def a_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def instance_a(vllm_env: Path, shared_tiers: list[dict[str, Any]], a_address: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """Instance A, starting in its child process (its host tier holds every prompt it computes)."""
    p2p = {"type": "p2p", "secret": SECRET, "listen": a_address}
    log = tmp_path_factory.mktemp("instance-a") / "engine.log"
    engine = EngineProcess(_model_path(), config(32, [*shared_tiers, p2p]), LLM_ARGS, log)
    yield engine
    engine.close()
    remove_stale_regions()  # A's host region, when A was SIGKILLed


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], instance_a: EngineProcess,
        shared_tiers: list[dict[str, Any]], a_address: str) -> Any:
    """Instance B, in this process (built while A starts). Its second p2p tier, `intruder`, has a
    wrong secret: it plays an unauthenticated peer asking A."""
    p2p = {"type": "p2p", "secret": SECRET, "peers": [a_address]}
    intruder = {"type": "p2p", "name": "intruder", "secret": secrets.token_hex(16),
                "peers": [a_address], "lookup_timeout_s": 0.3}
    return make_llm(config(16, [*shared_tiers, p2p, intruder]), dtype="float32")


@pytest.fixture(scope="module")
def computed_by_a(instance_a: EngineProcess, prompts: dict[str, list[int]]) -> dict[str, Any]:
    """A's results: for each reloaded prompt, its device-hit reference (the second request); for
    each recomputed one, its full compute."""
    requests = [(prompts[n], m) for n in RELOADED.values() for m in (1, MAX_TOKENS)]
    requests += [(prompts[n], MAX_TOKENS) for n in RECOMPUTED.values()]
    results = instance_a.generate(requests)
    names = [*RELOADED.values(), *RECOMPUTED.values()]
    refs = results[1 : 2 * len(RELOADED) : 2] + results[2 * len(RELOADED):]
    out = dict(zip(names, refs, strict=True))
    for name in RELOADED.values():
        assert out[name]["cached"] == hit_of(prompts[name])  # a device hit in A
    return out


def generate(llm: Any, prompt: list[int], tier: str, max_tokens: int = MAX_TOKENS,
             cache_salt: str | None = None) -> dict[str, Any]:
    """B serves `prompt` (for the tenant `cache_salt`), with only `tier` allowed to load its prefix;
    then its tier jobs finish."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"kvtier": {"load_tiers": [tier]}}}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
    request: dict[str, Any] = {"prompt_token_ids": prompt}
    if cache_salt is not None:
        request["cache_salt"] = cache_salt
    out = llm.generate([request], params, use_tqdm=False)[0]
    settle(connector_halves(llm)[0])
    return result_of(out)


def split(prompt: list[int], **loaded: int) -> dict[str, int]:
    """The expected per-request split of B (every configured tier named)."""
    out = {"device": 0, "host": 0, "obj": 0, "redis": 0, "p2p": 0, "intruder": 0, **loaded}
    out["recomputed"] = len(prompt) - sum(out.values())
    return out


def reset(llm: Any) -> None:
    """Empty B's device prefix cache and host tier (secondary tiers keep their chunks)."""
    scheduler, _ = connector_halves(llm)
    settle(scheduler)
    assert scheduler.reset_cache() and llm.reset_prefix_cache()


@pytest.mark.parametrize("tier", ["obj", "redis", "p2p"])
def test_b_reloads_from_the_shared_tier_what_only_a_computed(
    llm: Any, computed_by_a: dict[str, Any], prompts: dict[str, list[int]], tier: str
) -> None:
    prompt = prompts[RELOADED[tier]]

    again = generate(llm, prompt, tier)

    hit = hit_of(prompt)
    assert again["cached"] == hit
    assert again["kvtier"]["tokens"] == split(prompt, **{tier: hit})
    assert again["tokens"] == computed_by_a[RELOADED[tier]]["tokens"]


TENANT_PROMPT = {"obj": "birds", "redis": "chess", "p2p": "lighthouse"}
"""The prompt Alice (A) computes for each tier; Bob sends it to B under another `cache_salt`."""


@pytest.fixture(scope="module")
def computed_for_alice(instance_a: EngineProcess, prompts: dict[str, list[int]]) -> dict[str, Any]:
    """A's full computes of `TENANT_PROMPT`'s prompts for the tenant `alice` (stored in every tier)."""
    names = list(TENANT_PROMPT.values())
    results = instance_a.generate([(prompts[n], MAX_TOKENS) for n in names], cache_salt="alice")
    return dict(zip(names, results, strict=True))


@pytest.mark.parametrize("tier", ["obj", "redis", "p2p"])
def test_tenants_never_reuse_each_others_chunks(
    llm: Any, computed_for_alice: dict[str, Any], prompts: dict[str, list[int]], tier: str
) -> None:
    """Bob sends Alice's prompt, token for token, with his own `cache_salt`: the tier that holds
    Alice's chunks serves him nothing, and he gets the answer of a full compute; Alice's own
    request to B is then served from that tier (the control)."""
    name = TENANT_PROMPT[tier]
    prompt = prompts[name]

    bob = generate(llm, prompt, tier, cache_salt="bob")

    assert bob["cached"] == 0
    assert bob["kvtier"]["tokens"] == split(prompt)
    assert bob["tokens"] == computed_for_alice[name]["tokens"]
    alice = generate(llm, prompt, tier, cache_salt="alice")
    assert alice["kvtier"]["tokens"] == split(prompt, **{tier: hit_of(prompt)})


def test_a_peer_with_a_wrong_secret_is_refused_and_b_recomputes(
    llm: Any, instance_a: EngineProcess, computed_by_a: dict[str, Any],
    prompts: dict[str, list[int]],
) -> None:
    prompt = prompts[RECOMPUTED["auth"]]
    refused = instance_a.tier_counts("p2p")[TierCounter.AUTH_REFUSED]

    again = generate(llm, prompt, "intruder")

    assert again["cached"] == 0
    assert again["kvtier"]["tokens"] == split(prompt)
    assert again["tokens"] == computed_by_a[RECOMPUTED["auth"]]["tokens"]
    assert instance_a.tier_counts("p2p")[TierCounter.AUTH_REFUSED] > refused


def test_obj_server_killed_mid_run_requests_complete_then_the_tier_recovers(
    llm: Any, seaweed: SeaweedServer, prompts: dict[str, list[int]]
) -> None:
    scheduler, _ = connector_halves(llm)
    metrics = scheduler.accounting.metrics
    prompt = prompts["railway"]
    hit = hit_of(prompt)
    computed = generate(llm, prompt, "obj")
    ref = generate(llm, prompt, "obj")
    assert ref["cached"] == hit
    reset(llm)
    failures = metrics.value("kvtier_failures_total", tier="obj", op="load")

    # Killed with the new prompt's stores to obj in flight (no settle before the kill).
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": prompts["garden"]}],
                 SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    seaweed.kill()
    try:
        outs = [generate(llm, prompt, "obj"), generate(llm, prompts["garden"], "obj", max_tokens=2)]
    finally:
        seaweed.restart()

    assert outs[0]["kvtier"]["tokens"] == split(prompt)
    assert outs[0]["tokens"] == computed["tokens"]
    assert len(outs[1]["tokens"]) == 2
    assert metrics.value("kvtier_failures_total", tier="obj", op="load") > failures
    deadline = time.monotonic() + 30
    while True:
        reset(llm)
        again = generate(llm, prompt, "obj")
        if again["kvtier"]["tokens"]["obj"]:
            break
        assert time.monotonic() < deadline, "the obj tier did not recover"
        time.sleep(0.5)
    assert again["kvtier"]["tokens"] == split(prompt, obj=hit)
    assert again["tokens"] == ref["tokens"]


def test_a_killed_mid_transfer_b_recomputes(
    llm: Any, instance_a: EngineProcess, computed_by_a: dict[str, Any],
    prompts: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A is frozen (SIGSTOP, every thread of its process group stopped) the moment B submits its
    p2p load, then SIGKILLed once B's request waits unread at A (so B's tier is waiting on A's
    bytes): the load fails and B's request is recomputed."""
    scheduler, _ = connector_halves(llm)
    prompt = prompts[RECOMPUTED["kill"]]
    p2p = scheduler.manager.tiers["p2p"]
    submit = p2p.submit_load
    loads: list[Any] = []
    unread_at_kill: list[int] = []

    def kill_once_a_holds_a_request() -> None:
        deadline = time.monotonic() + 30
        while not instance_a.unread_tcp_bytes() and time.monotonic() < deadline:
            time.sleep(0.005)
        unread_at_kill.append(instance_a.unread_tcp_bytes())
        instance_a.signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_once_a_holds_a_request, daemon=True)

    def freeze_then_submit(job: Any) -> None:
        if not loads:
            instance_a.freeze()
            killer.start()
        loads.append(job)
        submit(job)

    monkeypatch.setattr(p2p, "submit_load", freeze_then_submit)
    metrics = scheduler.accounting.metrics
    failures = metrics.value("kvtier_failures_total", tier="p2p", op="load")

    try:
        again = generate(llm, prompt, "p2p")
    finally:
        if killer.is_alive():
            killer.join(60)
        with contextlib.suppress(ProcessLookupError):
            instance_a.signal(signal.SIGKILL)

    assert unread_at_kill and unread_at_kill[0] > 0, "B's request never reached the frozen A"
    assert [len(job.keys) for job in loads] == [hit_of(prompt) // CHUNK]
    assert again["kvtier"]["tokens"] == split(prompt)
    assert again["tokens"] == computed_by_a[RECOMPUTED["kill"]]["tokens"]
    assert metrics.value("kvtier_failures_total", tier="p2p", op="load") > failures
