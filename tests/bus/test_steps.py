"""Each step of a consumer loop on its own, on the in-memory broker (no Kafka, no Redis)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka.errors import TopicAuthorizationFailedError

from rollart.bus import BusProducer, DeadLetterQueue, DeadLetterRateExceeded, NotAuthorized, PermanentError
from rollart.bus.backend import OffsetAndMetadata, TopicPartition
from rollart.bus.commits import TransactionalCommits, WatermarkCommits
from rollart.bus.dlq import H_DLQ_ERROR, H_DLQ_OFFSET
from rollart.bus.offsets import OffsetTracker
from rollart.bus.steps import (Decoder, DeadLetterPolicy, DuplicateFilter, Failed, MessageContext, RetryPolicy,
                               handle_with_acks)
from rollart.endpoints import Endpoints
from rollart.messages import MessageDecodeError, TaskSpec, VersionAnnouncement
from tests.conftest import make_config

TASK = TaskSpec(group_id="g0", env="e", tag="t", group_size=1)


@pytest.fixture
async def producer():
    endpoints = Endpoints(f"memory://{uuid.uuid4().hex}", "redis://unused", "test", broker="memory")
    async with BusProducer(make_config(endpoints), endpoints) as producer:
        yield producer


async def record_of(producer: BusProducer, message=TASK, topic: str = "tasks"):
    meta = await producer.send_and_wait(topic, message, key="k")
    return producer._producer.broker.records(TopicPartition(meta.topic, meta.partition), meta.offset)[0]


# -- decode/accept -------------------------------------------------------------------------------


async def test_the_decoder_accepts_only_the_topics_kinds(producer):
    record = await record_of(producer)
    decoder = Decoder(producer.codec, {"tasks": (TaskSpec,), "policy.versions": (VersionAnnouncement,)})
    assert decoder.decode(record, "tasks").message == TASK
    assert decoder.decode(record, "scratch").message == TASK, "a topic not in accept takes any kind"
    with pytest.raises(MessageDecodeError):
        decoder.decode(record, "policy.versions")


# -- same-id wait and de-duplication ---------------------------------------------------------------


class FakeDedup:
    def __init__(self, seen=()):
        self.ids, self.marked = set(seen), []

    async def seen(self, message_id):
        return message_id in self.ids

    def mark(self, message_id):
        self.marked.append(message_id)
        self.ids.add(message_id)


async def test_a_copy_waits_for_the_one_being_handled_then_is_a_duplicate():
    duplicates = DuplicateFilter(FakeDedup())
    order = []

    async def handle(tag: str) -> None:
        async with duplicates.claim("m1") as new:
            order.append((tag, "start", new))
            if new:
                await asyncio.sleep(0.05)
            order.append((tag, "end", new))

    await asyncio.gather(asyncio.create_task(handle("first")), asyncio.create_task(handle("copy")))
    assert order == [("first", "start", True), ("first", "end", True), ("copy", "start", False), ("copy", "end", False)]
    assert duplicates.dedup.marked == ["m1"]


async def test_without_dedup_copies_run_one_after_the_other_and_a_failure_marks_nothing():
    assert await _claim_twice(DuplicateFilter(None)) == [True, True]
    dedup = FakeDedup()
    duplicates = DuplicateFilter(dedup)
    with pytest.raises(RuntimeError):
        async with duplicates.claim("m1"):
            raise RuntimeError("the DLQ failed")
    assert dedup.marked == [], "not processed: the redelivery must handle it"


async def _claim_twice(duplicates: DuplicateFilter) -> list[bool]:
    seen = []

    async def once() -> None:
        async with duplicates.claim("m1") as new:
            seen.append(new)
    await asyncio.gather(asyncio.create_task(once()), asyncio.create_task(once()))
    return seen


# -- retries ----------------------------------------------------------------------------------------


async def test_retries_back_off_then_succeed_or_fail_with_the_last_error():
    policy = RetryPolicy(attempts=3, backoff_s=0.001)
    assert [policy.backoff(n) for n in (1, 2, 3)] == [0.001, 0.002, 0.004]
    calls, errors = [], []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 2:
            raise ConnectionError("transient")
        return "ok"
    assert await policy.run(flaky, errors.append) == "ok" and len(calls) == 2 and len(errors) == 1

    async def broken() -> None:
        raise RuntimeError("env exploded")
    failed = await policy.run(broken)
    assert failed == Failed("handler: RuntimeError: env exploded", 3)


async def test_a_permanent_error_is_not_retried_and_carries_its_notifications():
    async def never() -> None:
        raise PermanentError("never valid", notify=[("rewards.results", TASK, "g0")])
    failed = await RetryPolicy(attempts=5, backoff_s=0).run(never)
    assert failed == Failed("handler: PermanentError: never valid", 1, [("rewards.results", TASK, {"key": "g0"})])


async def test_not_authorized_is_never_retried():
    calls = []

    async def refused() -> None:
        calls.append(1)
        raise NotAuthorized("User:x", ["t"], RuntimeError("denied"))
    with pytest.raises(NotAuthorized):
        await RetryPolicy(attempts=5, backoff_s=0).run(refused)
    assert calls == [1]


# -- ack-gated completion -------------------------------------------------------------------------


async def test_an_attempt_ends_when_its_outputs_are_acknowledged(producer):
    record = await record_of(producer)
    ack: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handler(envelope, ctx) -> None:
        ctx.acks.append(ack)
    attempt = asyncio.create_task(handle_with_acks(handler, None, MessageContext(record, "tasks", producer), "p"))
    await asyncio.sleep(0.02)
    assert not attempt.done(), "waits for the broker's ack"
    ack.set_result(None)
    assert await attempt == []


async def test_a_failed_ack_fails_the_attempt_and_an_acl_refusal_is_not_authorized(producer):
    record = await record_of(producer)

    async def lost(envelope, ctx) -> None:
        future = asyncio.get_running_loop().create_future()
        future.set_exception(ConnectionError("delivery timed out"))
        ctx.acks.append(future)
    with pytest.raises(ConnectionError):
        await handle_with_acks(lost, None, MessageContext(record, "tasks", producer), "p")

    async def refused(envelope, ctx) -> None:
        ctx.written.append("x.t")
        raise TopicAuthorizationFailedError()
    with pytest.raises(NotAuthorized, match="x.t"):
        await handle_with_acks(refused, None, MessageContext(record, "tasks", producer), "User:me")


async def test_deferred_outputs_are_returned_not_sent(producer):
    record = await record_of(producer)

    async def handler(envelope, ctx) -> None:
        await ctx.produce("trajectories.completed", TASK, key="g0")
    outputs = await handle_with_acks(handler, None, MessageContext(record, "tasks", producer, deferred=[]), "p")
    assert [topic for topic, _, _ in outputs] == ["trajectories.completed"]
    assert not producer._producer.broker.partitions(producer.names.physical("trajectories.completed"))


# -- dead letters ---------------------------------------------------------------------------------


async def test_a_dead_letter_keeps_provenance_then_notifies(producer):
    record = await record_of(producer)
    counted = []
    policy = DeadLetterPolicy(DeadLetterQueue(producer, stage="env", max_per_minute=10), producer,
                              transactional=False, counted=counted.append)
    notify = [("rewards.results", TASK, {"key": "g0"})]
    assert await policy.reject(record, "handler: boom", "", notify) == []
    broker = producer._producer.broker
    dead = broker.records(broker.partitions(producer.names.dlq(record.topic))[0], 0)
    assert dead[0].value == record.value and dict(dead[0].headers)[H_DLQ_OFFSET] == str(record.offset).encode()
    assert dict(dead[0].headers)[H_DLQ_ERROR] == b"handler: boom"
    assert counted == [record]
    results = producer.names.physical("rewards.results")
    assert sum(broker.end(tp) for tp in broker.partitions(results)) == 1, "the notification was produced"
    transactional = DeadLetterPolicy(DeadLetterQueue(producer, stage="env", max_per_minute=10), producer,
                                     transactional=True)
    assert await transactional.reject(record, "x", "", notify) == notify, "left for the transaction"


async def test_the_dead_letter_rate_limit_stops_rejecting(producer):
    record = await record_of(producer)
    policy = DeadLetterPolicy(DeadLetterQueue(producer, stage="env", max_per_minute=2), producer, transactional=False)
    await policy.reject(record, "a")
    await policy.reject(record, "b")
    with pytest.raises(DeadLetterRateExceeded):
        await policy.reject(record, "c")


# -- commit policies ------------------------------------------------------------------------------


class FakeConsumer:
    def __init__(self, refuse: Exception | None = None):
        self.commits, self.refuse = [], refuse

    async def commit(self, offsets):
        if self.refuse is not None:
            raise self.refuse
        self.commits.append(offsets)


TP = TopicPartition("t", 0)


async def test_watermark_commits_flush_marks_first_and_survive_a_refused_commit():
    from rollart.bus.backend import CommitFailed

    tracker = OffsetTracker()
    for offset in (0, 1, 2):
        tracker.dispatch(TP, offset)
    flushed = []

    class Marks:
        async def flush(self):
            flushed.append(len(consumer.commits))

    consumer = FakeConsumer()
    commits = WatermarkCommits(tracker, consumer, Marks(), "env")
    await commits.complete(TP, 1, [])
    assert await commits.commit() == {TP: OffsetAndMetadata(0, "rollart.done=1")}
    assert flushed == [0], "marks reach Redis before the offset moves"
    assert await commits.commit() == {}, "nothing new"
    await commits.complete(TP, 0, [])
    commits.consumer = FakeConsumer(refuse=CommitFailed("rebalanced"))
    assert await commits.commit() == {}, "refused: logged, redelivered to the new owner"


async def test_a_failed_transaction_commit_is_fatal():
    class Txn:
        async def add(self, outputs, mark_done):
            self.outputs = outputs
            mark_done()

        async def commit(self, to_commit):
            raise RuntimeError("fenced")

    tracker, fatal, txn = OffsetTracker(), [], Txn()
    tracker.dispatch(TP, 0)
    commits = TransactionalCommits(tracker, txn, "env", fatal.append)
    await commits.complete(TP, 0, [("t", TASK, {})])
    assert txn.outputs == [("t", TASK, {})] and tracker.to_commit() == {TP: OffsetAndMetadata(1, "")}
    assert await commits.commit() == {}
    assert [str(e) for e in fatal] == ["fenced"]
