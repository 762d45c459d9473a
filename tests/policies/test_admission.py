"""The frequency sketch, the built-in admission policies, their chain, and their config errors."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.format.chunks import HOST
from kvtier.policies.admission import AdmissionChain, FrequencyAdmission, PriorityAdmission
from kvtier.policies.base import AdmissionSettings, AdmitAll, Retention
from kvtier.policies.sketch import COUNTER_MAX, FrequencySketch


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def test_sketch_never_underestimates_and_rarely_overestimates() -> None:
    sketch = FrequencySketch(width=1 << 10, sample_size=1 << 30)
    for i in range(300):
        for _ in range(i % 4):
            sketch.add(k(i))
    assert all(sketch.estimate(k(i)) >= i % 4 for i in range(300))
    wrong = sum(sketch.estimate(k(i)) != i % 4 for i in range(300))
    assert wrong <= 3  # 450 additions over 4 rows of 1,024 counters
    assert sum(sketch.estimate(k(i)) for i in range(1000, 1300)) <= 3


def test_sketch_saturates_and_has_bounded_memory() -> None:
    sketch = FrequencySketch(width=64, depth=4, sample_size=1 << 30)
    for _ in range(100):
        sketch.add(b"hot")
    assert sketch.estimate(b"hot") == COUNTER_MAX
    for i in range(5000):
        sketch.add(k(i))
    assert sketch.nbytes == 64 * 4


def test_sketch_ages_by_halving_every_sample() -> None:
    sketch = FrequencySketch(width=1 << 12, sample_size=20)
    for _ in range(8):
        sketch.add(b"old")
    assert sketch.estimate(b"old") == 8 and sketch.agings == 0
    for i in range(12):  # the 20th addition halves every counter
        sketch.add(k(i))
    assert sketch.agings == 1
    assert sketch.estimate(b"old") == 4
    for i in range(100, 140):
        sketch.add(k(i))
    assert sketch.estimate(b"old") == 1  # faded: it was not seen again


@pytest.mark.parametrize("kwargs", [{"width": 3}, {"width": 0}, {"depth": 0}, {"depth": 9},
                                    {"sample_size": 0}])
def test_sketch_rejects_bad_geometry(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        FrequencySketch(**kwargs)


def test_frequency_admits_into_secondary_tiers_from_the_min_seen_th_sighting() -> None:
    policy = FrequencyAdmission(AdmissionSettings(min_seen=3))
    seen = []
    for _ in range(4):
        seen.append(policy.admit(b"a", "fs"))
        policy.record_access(b"a")
    assert seen == [False, False, False, True]
    assert policy.admit(b"a", "fs") and not policy.admit(b"b", "fs")


def test_frequency_refuses_nothing_at_the_host_gate_and_ranks_probation() -> None:
    policy = FrequencyAdmission(AdmissionSettings(min_seen=2))
    lead, new, decoded = b"lead", b"new", b"decoded"
    policy.record_access(lead)
    policy.record_access(new)
    assert policy.admit(new, HOST) and policy.admit(b"never seen", HOST)
    # First request: nothing reused yet, so its chunks are cold probation.
    assert policy.retention(new, lead) is Retention.COLD
    # A later request continues the same prefix: its first chunk was seen twice, so a chunk it
    # computes extends a reused prefix (warm), whether it came in the prompt or from decode.
    policy.record_access(lead)
    assert policy.retention(decoded, lead) is Retention.WARM
    assert not policy.admit(decoded, "fs")  # seen by no request: not yet for a secondary tier
    policy.record_access(new)
    assert policy.retention(new, b"cold lead") is Retention.SETTLED
    # With min_seen 1 the computing request's own sighting suffices, decode chunks included.
    once = FrequencyAdmission(AdmissionSettings(min_seen=1))
    assert once.retention(decoded, b"unseen") is Retention.SETTLED


def test_chain_probation_takes_the_lowest_retention_and_names_its_policy() -> None:
    settings = AdmissionSettings(min_seen=2)

    class Warm(PriorityAdmission):
        name = "warm"

        def retention(self, key: bytes, lead: bytes) -> Retention:
            return Retention.WARM

    frequency = FrequencyAdmission(settings)
    chain = AdmissionChain([Warm(settings), frequency])
    frequency.record_access(b"a")
    frequency.record_access(b"a")
    assert chain.probation([b"a", b"b"], b"lead") == {
        b"a": (Retention.WARM, "warm"), b"b": (Retention.COLD, "frequency")}
    assert AdmissionChain([PriorityAdmission(settings), frequency]).probation([b"a"], b"lead") == {}
    assert AdmissionChain([AdmitAll()]).probation([b"x"], b"lead") == {}


def test_priority_uses_each_tiers_minimum() -> None:
    policy = PriorityAdmission(AdmissionSettings(min_retention_priority={HOST: 0, "fs": 35}))
    assert policy.admit(b"a", HOST, 0)
    assert not policy.admit(b"a", "fs", 34) and policy.admit(b"a", "fs", 35)
    assert policy.admit(b"a", "unknown", 0)


def test_chain_admits_when_all_admit_and_names_the_first_refusal() -> None:
    settings = AdmissionSettings(min_seen=1, min_retention_priority={"fs": 35})
    chain = AdmissionChain([AdmitAll(settings), FrequencyAdmission(settings), PriorityAdmission(settings)])
    assert not chain.admits_all and AdmissionChain([AdmitAll()]).admits_all
    assert chain.rejected_by(b"a", "fs", 90) == "frequency"
    chain.record_access(b"a")
    assert chain.rejected_by(b"a", "fs", 10) == "priority"
    assert chain.rejected_by(b"a", "fs", 90) is None


def base(**extra: Any) -> dict[str, Any]:
    return {"cpu_bytes_to_use": 1 << 20, **extra}


def test_config_resolves_a_list_with_settings_per_tier() -> None:
    config = KVTierConfig.from_dict(base(
        admission_policy=["frequency", "priority"], admission_min_seen=3,
        host_min_retention_priority=10,
        secondary_tiers=[{"type": "memory", "name": "m1"},
                         {"type": "memory", "name": "m2", "min_retention_priority": 80}],
    ))
    assert config.admission_policy == ("frequency", "priority")
    assert config.admission_classes == (FrequencyAdmission, PriorityAdmission)
    settings = config.admission_settings()
    assert settings.min_seen == 3
    assert dict(settings.min_retention_priority) == {HOST: 10, "m1": 35, "m2": 80}
    assert config.secondary_tiers[1].options == {}
    assert KVTierConfig.from_dict(base()).admission_classes == (AdmitAll,)


def test_config_takes_a_policy_class_from_module_path() -> None:
    config = KVTierConfig.from_dict(base(
        admission_policy=["priority", "PriorityAdmission"],
        admission_policy_module_path="kvtier.policies.admission"))
    assert config.admission_classes == (PriorityAdmission, PriorityAdmission)


@pytest.mark.parametrize(("raw", "key", "hint"), [
    (base(admission_policy="frequncy"), "admission_policy", "did you mean 'frequency'"),
    (base(admission_policy=["all", "bogus"]), "admission_policy[1]", "known: all, frequency"),
    (base(admission_policy=[]), "admission_policy", "non-empty list"),
    (base(admission_policy=["all", "all"]), "admission_policy", "twice"),
    (base(admission_min_seen=0), "admission_min_seen", "integer >= 1"),
    (base(host_min_retention_priority=101), "host_min_retention_priority", "0 to 100"),
    (base(secondary_tiers=[{"type": "memory", "min_retention_priority": -1}]),
     "secondary_tiers[0].min_retention_priority", "0 to 100"),
    (base(secondary_tiers=[{"type": "memory", "min_retention_priority": 50.5}]),
     "secondary_tiers[0].min_retention_priority", "0 to 100"),
])
def test_bad_admission_config_names_the_key(raw: dict[str, Any], key: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint) as e:
        KVTierConfig.from_dict(raw)
    assert e.value.key == key
