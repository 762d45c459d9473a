"""`max_client_priority`: the operator's cap on the retention priority an API client can give its
request (the kvtier `priority` option in `kv_transfer_params`, or vLLM's own request priority),
through the planner as the connector drives it; the key is validated like every priority."""

from __future__ import annotations

import pytest

from kvtier.config import KVTierConfig
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport
from kvtier.errors import ConfigError
from tests.engine.fakes import ROW_BYTES, FakeRequest, geometry

PROMPT = list(range(200, 214))  # 14 tokens: 3 full chunks of 4


def stored_priorities(cap: int | None, req: FakeRequest) -> list[int]:
    """The host-tier priorities of `req`'s chunks once a planner capped at `cap` stored them."""
    extra = {"cpu_bytes_to_use": 8 * ROW_BYTES}
    if cap is not None:
        extra["max_client_priority"] = cap
    planner = Planner(KVTierConfig.from_dict(extra), geometry(), 1)
    try:
        planner.bind_block_ids(lambda req_id: ([4, 1, 2, 3],))
        assert planner.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
        meta = planner.step({req.request_id: req.num_tokens})
        req.num_computed_tokens = req.num_tokens
        planner.copies_done(CopyReport({job.job_id: (1, True) for job in meta.stores}))
        planner.finished(req)  # type: ignore[arg-type]
        return [planner.manager.host.priority_of(k) for k in planner.hasher.keys(PROMPT)]
    finally:
        planner.shutdown()


def test_a_clients_priority_is_capped_by_the_operator() -> None:
    option = {"kvtier": {"priority": 100}}
    assert stored_priorities(None, FakeRequest("a", PROMPT, kv_transfer_params=option)) == [100] * 3
    assert stored_priorities(60, FakeRequest("a", PROMPT, kv_transfer_params=option)) == [60] * 3
    assert stored_priorities(60, FakeRequest("b", PROMPT, priority=-45)) == [60] * 3  # 95 asked
    low = {"kvtier": {"priority": 20}}
    assert stored_priorities(60, FakeRequest("c", PROMPT, kv_transfer_params=low)) == [20] * 3


@pytest.mark.parametrize("bad", [-1, 101, 50.5, True, "60"])
def test_max_client_priority_is_an_integer_from_0_to_100(bad: object) -> None:
    with pytest.raises(ConfigError) as e:
        KVTierConfig.from_dict({"cpu_bytes_to_use": 1, "max_client_priority": bad})
    assert e.value.key == "max_client_priority"
    assert KVTierConfig.from_dict({"cpu_bytes_to_use": 1}).max_client_priority == 100
