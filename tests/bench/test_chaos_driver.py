"""The campaign's driver: which secondary tiers each request may load from, with and without the
rotation the `full` preset uses (real vLLM `SamplingParams`, an engine that echoes the reference)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.bench.chaos.driver import drive
from kvtier.bench.chaos.presets import PRESETS
from kvtier.bench.chaos.reference import Reference, Turn


@dataclass
class _Completion:
    token_ids: tuple[int, ...]
    finish_reason: str = "length"


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    finished: bool = True
    kv_transfer_params: dict[str, Any] | None = None


class EchoEngine:
    """Finishes every request added at its next step with the reply the reference expects."""

    def __init__(self, ref: Reference) -> None:
        self.ref = ref
        self.added: list[tuple[str, Any]] = []
        self._pending: list[str] = []

    def add_request(self, req_id: str, prompt: dict[str, Any], params: Any) -> None:
        self.added.append((req_id, params))
        self._pending.append(req_id)

    def step(self) -> list[_Output]:
        out = []
        for req_id in self._pending:
            conv, _, turn = (int(x) for x in req_id.split("-")[1:4])
            out.append(_Output(req_id, [_Completion(self.ref.turns[conv][turn].reply)]))
        self._pending = []
        return out

    def abort_request(self, ids: list[str]) -> None:
        raise AssertionError(f"nothing should hang: {ids}")


def _reference(conversations: int = 2, turns: int = 3) -> Reference:
    return Reference(tuple(tuple(Turn((c, t, 1), (c, t, 2)) for t in range(turns))
                           for c in range(conversations)))


def _load_tiers(params: Any) -> list[str] | None:
    extra = params.extra_args or {}
    return extra.get("kv_transfer_params", {}).get("kvtier", {}).get("load_tiers")


def test_requests_take_turns_at_the_tier_they_load_from() -> None:
    ref = _reference()
    engine = EchoEngine(ref)
    rotation = [("fs",), ("obj",), ("redis",)]
    done = drive(engine, ref, 2, lambda rnd: rnd < 1, hang_s=60.0, load_tiers=rotation)
    assert len(done) == 12 and all(o.ok for o in done)
    assert [_load_tiers(params) for _, params in engine.added] == [["fs"], ["obj"], ["redis"]] * 4


def test_without_a_rotation_every_tier_may_serve() -> None:
    ref = _reference()
    engine = EchoEngine(ref)
    done = drive(engine, ref, 2, lambda rnd: False, hang_s=60.0)
    assert len(done) == 6 and all(o.ok for o in done)
    assert all(_load_tiers(params) is None for _, params in engine.added)


def test_the_full_campaign_rotates_and_the_smoke_does_not() -> None:
    full = PRESETS["full"]
    assert set(full.load_rotation) == set(full.tiers) == {"fs", "obj", "redis", "cluster", "p2p"}
    assert all(full.load_rotation.count(t) >= 2 * full.load_rotation.count("fs") for t in full.detect_tiers)
    assert full.min_detected >= 300
    assert not PRESETS["smoke"].load_rotation
