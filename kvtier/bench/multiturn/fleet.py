"""Several running instances driven as one fleet: a routing rule, and the fleet-wide token split.

`kvtier bench multiturn --endpoints URL,URL[,...]` sends each request to one instance, chosen by
`Router`:

- `round-robin`: each turn of a conversation goes to the instance after the one that served its
  previous turn (its first turn to instance `conversation` modulo the number of instances), so
  the load is spread evenly and no turn finds its previous turn's KV on its own instance: the
  worst case for locality. (One counter over all requests, as a plain load balancer keeps, would
  not be: the workload asks its conversations' turns in FIFO order, so with a number of
  conversations that is a multiple of the fleet's size, each conversation would come back to the
  same instance every turn.)
- `prefix-affinity`: every turn of a conversation goes to the same instance (conversation index
  modulo the number of instances), as a router that hashes the conversation's prefix would: each
  instance keeps its own conversations. The locality reference.

`FleetClient` has the interface of one `ChatClient` and marks each record with the instance that
served it (`RequestRecord.instance`). A point's split is the sum over the instances of each one's
`/metrics` delta (`summary.sum_splits`); the point also lists each instance's own split, requests and
TTFT (`instance_entries`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvtier.bench.multiturn.conversation import Message
from kvtier.bench.multiturn.summary import RequestRecord, summary

ROUTES = ("round-robin", "prefix-affinity")


class Chat(Protocol):
    """What the runner needs of a client: one chat turn, and closing."""

    async def chat(self, conversation: int, turn: int,
                   messages: list[Message]) -> tuple[RequestRecord, str]: ...

    async def aclose(self) -> None: ...


class Router:
    """Picks the instance (0 .. `instances`-1) for each request by `rule` (one of `ROUTES`)."""

    def __init__(self, rule: str, instances: int) -> None:
        check_route(rule)
        if instances < 1:
            raise ValueError(f"a fleet needs at least one instance, not {instances}")
        self.rule = rule
        self.instances = instances

    def pick(self, conversation: int, turn: int) -> int:
        """The instance for turn `turn` (from 1) of `conversation`."""
        if self.rule == "prefix-affinity":
            return conversation % self.instances
        return (conversation + turn - 1) % self.instances


def check_route(rule: str) -> None:
    """ValueError naming the known rules when `rule` is not one."""
    if rule not in ROUTES:
        raise ValueError(f"--route {rule}: unknown (known: {', '.join(ROUTES)})")


class FleetClient:
    """One `Chat` per instance behind a `Router`: `chat` sends the turn to the instance the router
    picks and sets the record's `instance`."""

    def __init__(self, clients: Sequence[Chat], router: Router) -> None:
        if len(clients) != router.instances:
            raise ValueError(f"{len(clients)} clients for a router over {router.instances} instances")
        self.clients = list(clients)
        self.router = router

    async def chat(self, conversation: int, turn: int,
                   messages: list[Message]) -> tuple[RequestRecord, str]:
        instance = self.router.pick(conversation, turn)
        record, reply = await self.clients[instance].chat(conversation, turn, messages)
        record.instance = instance
        return record, reply

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


def merge_transfers(transfers: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """kvtier's per "<tier>.<op>" transfer seconds and bytes, summed over the instances."""
    out: dict[str, dict[str, float]] = {}
    for one in transfers:
        for key, entry in one.items():
            total = out.setdefault(key, {"seconds": 0.0, "bytes": 0.0})
            for field, value in entry.items():
                total[field] = total.get(field, 0.0) + value
    return out


def instance_entries(urls: Sequence[str], splits: Sequence[Mapping[str, int]],
                     records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Per instance: its URL, its own split (its `/metrics` delta), the requests it served, their
    prompt tokens and TTFT percentiles (failed requests left out)."""
    out = []
    for index, (url, split) in enumerate(zip(urls, splits, strict=True)):
        mine = [r for r in records if r.instance == index and not r.error]
        out.append({"url": url, "tokens": dict(split), "requests": len(mine),
                    "prompt_tokens": sum(r.prompt_tokens for r in mine),
                    "ttft_s": summary([r.ttft_s for r in mine])})
    return out
