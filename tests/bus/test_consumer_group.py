"""Two consumers in one group share partitions and take over each other's when one stops."""

from __future__ import annotations

import asyncio
from collections import Counter

from rollart.messages import TaskSpec
from tests.conftest import ALL_BROKERS, eventually

pytestmark = ALL_BROKERS  # the broker contract


def _task(i: int) -> TaskSpec:
    return TaskSpec(group_id=f"g{i}", env="frozenlake", tag="frozenlake", group_size=4, seed=i)


async def _produce(runtime, n: int, start: int = 0) -> None:
    acks = [await runtime.producer.send("tasks", _task(i), key=f"g{i}") for i in range(start, start + n)]
    await asyncio.gather(*acks)


async def test_group_members_share_and_take_over_partitions(runtime, loops):
    handled: dict[str, Counter] = {"a": Counter(), "b": Counter()}

    def handler_for(member: str):
        async def handle(envelope, ctx) -> None:
            handled[member][envelope.message.group_id] += 1
        return handle

    a = await loops.start(runtime.consumer_loop("env", ["tasks"], handler_for("a")))
    b = await loops.start(runtime.consumer_loop("env", ["tasks"], handler_for("b")), wait_assigned=False)
    # The rebalance settles into disjoint halves (mid-rebalance, a member's view of what it holds may
    # still include what it is about to give up): never a partition owned by both once settled.
    await eventually(lambda: a.assignment and b.assignment and len(a.assignment | b.assignment) == 8
                     and not (a.assignment & b.assignment), what="both members assigned, disjointly")

    await _produce(runtime, 80)
    await eventually(lambda: sum(handled["a"].values()) + sum(handled["b"].values()) >= 80, what="80 handled")
    assert handled["a"] and handled["b"], "both members should have processed messages"

    await loops.stop(a)  # graceful: drains, commits, leaves the group
    await eventually(lambda: len(b.assignment) == 8, what="b takes over all 8 partitions")
    await _produce(runtime, 40, start=80)
    await eventually(lambda: sum(handled["b"].values()) + sum(handled["a"].values()) >= 120, what="120 handled")
    everything = handled["a"] + handled["b"]
    assert set(everything) == {f"g{i}" for i in range(120)}
    assert max(everything.values()) == 1, "a committed message was handled twice after the takeover"
