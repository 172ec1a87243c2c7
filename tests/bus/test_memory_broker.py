"""The in-memory broker keeps the consumer-group contract: partitions, groups, rebalances, commits."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rollart.bus.backend import CommitFailed, OffsetAndMetadata, TopicPartition
from rollart.bus.memory import InMemoryBroker
from rollart.timeouts import wait_for


class Listener:
    def __init__(self) -> None:
        self.events: list[tuple[str, set[TopicPartition]]] = []

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.events.append(("revoked", revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.events.append(("assigned", assigned))


@pytest.fixture
def broker() -> InMemoryBroker:
    return InMemoryBroker.at(f"memory://{uuid.uuid4().hex}")


async def member(broker: InMemoryBroker, topic: str = "t", group: str = "g"):
    consumer, listener = broker.consumer(group), Listener()
    consumer.subscribe([topic], listener)
    await consumer.start()
    return consumer, listener


async def poll_until(predicate, *consumers, rounds: int = 100) -> None:
    for _ in range(rounds):
        await asyncio.gather(*(c.getmany(timeout_ms=10) for c in consumers))
        if predicate():
            return
    raise AssertionError("the group did not settle")


def test_the_bootstrap_names_one_broker_per_process():
    assert InMemoryBroker.at("memory://a") is InMemoryBroker.at("memory://a")
    assert InMemoryBroker.at("memory://a") is not InMemoryBroker.at("memory://b")
    with pytest.raises(ValueError, match="memory://"):
        InMemoryBroker.at("127.0.0.1:9092")


def test_keyed_records_stay_on_one_partition_and_offsets_count_up(broker):
    broker.create_topic("t", 4)
    metas = [broker.append("t", b"v%d" % i, key=b"same") for i in range(3)]
    assert len({m.partition for m in metas}) == 1
    assert [m.offset for m in metas] == [0, 1, 2]
    assert broker.end(TopicPartition("t", metas[0].partition)) == 3
    assert broker.create_topic("t", 8) is False, "an existing topic keeps its partitions"
    broker.append("new", b"x")
    assert broker.partitions("new") == [TopicPartition("new", 0)], "created on first produce"
    with pytest.raises(ValueError):
        broker.append("t", b"x", partition=9)


async def test_members_split_the_partitions_and_take_over_when_one_leaves(broker):
    broker.create_topic("t", 4)
    a, a_events = await member(broker)
    await poll_until(lambda: len(a.assignment()) == 4, a)
    b, _ = await member(broker)
    await poll_until(lambda: a.assignment() and b.assignment(), a, b)
    assert not a.assignment() & b.assignment() and len(a.assignment() | b.assignment()) == 4
    assert ("revoked", {TopicPartition("t", p) for p in range(4)}) in a_events.events, "eager: all revoked first"
    await b.stop()
    await poll_until(lambda: len(a.assignment()) == 4, a)


async def test_a_member_resumes_at_the_commit_and_reads_its_metadata(broker):
    broker.create_topic("t", 1)
    tp = TopicPartition("t", 0)
    for i in range(5):
        broker.append("t", b"%d" % i)
    a, _ = await member(broker)
    batch = await a.getmany(timeout_ms=100)
    assert [r.offset for r in batch[tp]] == [0, 1, 2, 3, 4]
    await a.commit({tp: OffsetAndMetadata(2, "rollart.done=1")})
    await a.stop()
    with pytest.raises(CommitFailed):
        await a.commit({tp: OffsetAndMetadata(5, "")})  # no longer a member: refused
    b, _ = await member(broker)
    batch = await b.getmany(timeout_ms=100)
    assert [r.offset for r in batch[tp]] == [2, 3, 4]
    assert await b.committed({tp}) == {tp: OffsetAndMetadata(2, "rollart.done=1")}


async def test_paused_partitions_return_nothing_until_resumed(broker):
    broker.create_topic("t", 1)
    tp = TopicPartition("t", 0)
    a, _ = await member(broker)
    await a.getmany(timeout_ms=0)
    a.pause(tp)
    broker.append("t", b"x")
    assert await a.getmany(timeout_ms=20) == {} and a.paused() == {tp}
    a.resume(tp)
    assert [r.value for r in (await a.getmany(timeout_ms=20))[tp]] == [b"x"]


async def test_a_waiting_fetch_wakes_on_a_new_record(broker):
    broker.create_topic("t", 1)
    a, _ = await member(broker)
    await a.getmany(timeout_ms=0)
    asyncio.get_running_loop().call_later(0.05, broker.append, "t", b"late")
    started = asyncio.get_running_loop().time()
    batch = await a.getmany(timeout_ms=5000)
    assert batch and asyncio.get_running_loop().time() - started < 1.0


async def test_a_handler_runs_in_a_consumer_loop_without_kafka_or_redis(broker):
    from rollart.bus import BusProducer, ConsumerLoop
    from rollart.endpoints import Endpoints
    from rollart.messages import TaskSpec
    from rollart.topics import expand_catalog
    from rollart.topics.admin import apply_topics
    from tests.conftest import make_config

    bootstrap = next(k for k, v in InMemoryBroker._brokers.items() if v is broker)
    endpoints = Endpoints(bootstrap, "redis://unused", "test", broker="memory")
    config = make_config(endpoints)
    await apply_topics(config, endpoints, expand_catalog(config))
    handled = []

    async def handle(envelope, ctx) -> None:
        handled.append(envelope.message.group_id)
        await ctx.produce("trajectories.completed", envelope.message, key=envelope.message.group_id)

    async with BusProducer(config, endpoints) as producer:
        for i in range(10):
            await producer.send_and_wait("tasks", TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1),
                                         key=f"g{i}")
        loop = ConsumerLoop(config=config, endpoints=endpoints, group="env", topics=["tasks"], handler=handle,
                            producer=producer)
        running = asyncio.create_task(loop.run())
        for _ in range(100):
            if len(handled) == 10:
                break
            await asyncio.sleep(0.02)
        loop.stop()
        await running
    assert sorted(handled) == sorted(f"g{i}" for i in range(10))
    outputs = producer.names.physical("trajectories.completed")
    assert sum(broker.end(tp) for tp in broker.partitions(outputs)) == 10
    committed = broker.group(f"{config.job}.env").committed
    assert sum(c.offset for c in committed.values()) == 10, "every input committed on the way out"


async def test_a_stopping_loop_leaves_when_its_final_commit_is_never_answered(broker, monkeypatch):
    """A broker with no coordinator to answer (electing leaders) has the client retry a commit for as
    long as it likes: the member still leaves, within ``bus.commit_timeout_s``, its offsets uncommitted."""
    from rollart.bus import BusProducer, ConsumerLoop
    from rollart.bus.memory import MemoryGroupConsumer
    from rollart.endpoints import Endpoints
    from rollart.messages import TaskSpec
    from rollart.topics import expand_catalog
    from rollart.topics.admin import apply_topics
    from tests.conftest import make_config

    bootstrap = next(k for k, v in InMemoryBroker._brokers.items() if v is broker)
    endpoints = Endpoints(bootstrap, "redis://unused", "test", broker="memory")
    config = make_config(endpoints, bus={"commit_interval_s": 60, "commit_timeout_s": 0.5})
    await apply_topics(config, endpoints, expand_catalog(config))
    handled = []

    async def handle(envelope, ctx) -> None:
        handled.append(envelope.message.group_id)

    async def unanswered(self, offsets) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(MemoryGroupConsumer, "commit", unanswered)
    async with BusProducer(config, endpoints) as producer:
        await producer.send_and_wait("tasks", TaskSpec(group_id="g0", env="e", tag="t", group_size=1), key="g0")
        loop = ConsumerLoop(config=config, endpoints=endpoints, group="env", topics=["tasks"], handler=handle,
                            producer=producer)
        running = asyncio.create_task(loop.run())
        for _ in range(100):
            if handled:
                break
            await asyncio.sleep(0.02)
        loop.stop()
        await wait_for(running, 10)  # without the bound: forever
    assert handled == ["g0"]
    assert not broker.group(f"{config.job}.env").committed, "nothing committed: the next owner redoes it"


async def test_a_member_that_misses_a_rebalance_is_dropped_and_joins_again(broker, monkeypatch):
    import rollart.bus.memory as memory

    monkeypatch.setattr(memory, "REBALANCE_TIMEOUT_S", 0.1)
    broker.create_topic("t", 2)
    a, _ = await member(broker)
    await poll_until(lambda: len(a.assignment()) == 2, a)
    b, _ = await member(broker)  # a does not poll: b's join waits for it, then drops it
    await poll_until(lambda: len(b.assignment()) == 2, b)
    with pytest.raises(CommitFailed):  # a still believes it owns them: a zombie, refused
        await a.commit({TopicPartition("t", 0): OffsetAndMetadata(0, "")})
    await poll_until(lambda: a.assignment() and b.assignment(), a, b)
    assert not a.assignment() & b.assignment()
