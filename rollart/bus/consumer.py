"""The consumer loop every stage runs: fetch, decode, de-duplicate, handle, acknowledge, commit.

A stage supplies a *handler*: a plain ``async def handle(envelope, ctx)`` of one decoded message.
The loop owns everything else:

* at-least-once: an offset is committed only after its handler returned and every record the handler
  produced through ``ctx.produce`` was acknowledged by the broker; commits are periodic and
  watermark-based (see :mod:`rollart.bus.offsets`), so handlers may finish out of order;
* de-duplication by message id (:mod:`rollart.bus.dedup`);
* failures: undecodable messages go straight to the topic's DLQ; a handler that raises is retried
  (``bus.handler_attempts``, exponential backoff) and then dead-lettered; the loop goes on;
* bounded in-flight work: at ``max_in_flight`` the loop pauses its partitions (it keeps polling, so
  the group does not consider it dead) and resumes when handlers finish;
* ordering: messages with the same key are handled in order (``ordering="key"``), or per partition,
  or not at all;
* rebalances: on revocation the loop lets in-flight handlers of the revoked partitions finish (up to
  ``bus.drain_timeout_s``), commits what is done, then calls the stage's ``on_revoke``;
* graceful stop (SIGTERM): stop fetching, drain, commit, leave the group.

The loop itself is the composition: fetching, dispatch, ordering, pausing and rebalances live here;
what happens to one record is the chain of steps in :mod:`rollart.bus.steps`, and when its offset
counts as done and is committed is a policy of :mod:`rollart.bus.commits`. The broker is reached
through :class:`~rollart.bus.backend.GroupConsumer` (Kafka and Tansu, or the in-memory broker).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Literal, Sequence

from rollart import health
from rollart.bus.backend import ConsumerRecord, GroupConsumer, OffsetAndMetadata, TopicPartition
from rollart.bus.commits import CommitPolicy, TransactionalCommits, WatermarkCommits
from rollart.bus.dedup import Deduplicator
from rollart.bus.dlq import DeadLetterQueue, DeadLetterRateExceeded
from rollart.bus.kafka import group_consumer
from rollart.bus.offsets import OffsetTracker
from rollart.bus.producer import BusProducer, NotAuthorized, client_principal
from rollart.bus.steps import (Decoder, DeadLetterPolicy, DuplicateFilter, Failed, Handler, MessageContext, Output,
                               PermanentError, RetryPolicy, accepted_kinds, handle_with_acks)
from rollart.bus.transaction import Transaction
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints
from rollart.messages import MessageDecodeError
from rollart.metrics import (
    CONSUMER_LAG,
    HANDLER_LATENCY,
    IN_FLIGHT,
    LOOP_PROGRESS,
    MESSAGES_DEAD_LETTERED,
    MESSAGES_DEDUPLICATED,
    MESSAGES_FAILED,
    MESSAGES_PROCESSED,
    PAUSED,
)
from rollart.timeouts import wait_for

__all__ = ["ConsumerLoop", "Handler", "MessageContext", "Ordering", "PermanentError"]

FAILURE_DECODE, FAILURE_HANDLER = "decode", "handler"
FAILURE_REASONS = (FAILURE_DECODE, FAILURE_HANDLER)

log = logging.getLogger(__name__)

Ordering = Literal["key", "partition", "none"]
PartitionsCallback = Callable[[set[TopicPartition]], Awaitable[None]]


class ConsumerLoop:
    def __init__(
        self,
        *,
        config: RollartConfig,
        endpoints: Endpoints,
        group: str,
        topics: Sequence[str],
        handler: Handler,
        producer: BusProducer,
        dedup: Deduplicator | None = None,
        accept: dict[str, tuple[type, ...]] | None = None,
        ordering: Ordering = "key",
        fetch_max_wait_ms: int | None = None,
        fetch_min_bytes: int = 1,
        max_in_flight: int | None = None,
        on_assign: PartitionsCallback | None = None,
        on_revoke: PartitionsCallback | None = None,
        client_id: str | None = None,
        drain_timeout_s: float | None = None,
        transactional_id: str | None = None,
    ):
        self.config = config
        self.group = group
        self.handler = handler
        self.producer = producer
        if transactional_id and dedup is not None:
            raise ValueError(f"{group}: a transactional loop de-duplicates by its transaction, not Redis marks "
                             "(a mark could outlive the aborted transaction it belonged to)")
        # exactly-once: outputs and input offsets commit in one transaction of this producer
        self.transaction = Transaction(BusProducer(config, endpoints, transactional_id=transactional_id,
                                                   client_id=f"{config.kafka.client_id}-{group}-txn"),
                                       f"{config.job}.{group}") if transactional_id else None
        self.dedup = dedup
        self.ordering = ordering
        self.max_in_flight = max_in_flight or config.bus.max_in_flight
        self.on_assign = on_assign
        self.on_revoke = on_revoke
        self.drain_timeout_s = config.bus.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.names = producer.names
        self.codec = producer.codec
        self._physical = {self.names.physical(t): t for t in topics}
        self._labels = (config.job, group)
        self.dlq = DeadLetterQueue(producer, stage=group, max_per_minute=config.bus.dlq_max_per_minute)
        self._consumer = group_consumer(
            config, endpoints, f"{config.job}.{group}", client_id=client_id or f"{config.kafka.client_id}-{group}",
            fetch_max_wait_ms=config.bus.fetch_max_wait_ms if fetch_max_wait_ms is None else fetch_max_wait_ms,
            fetch_min_bytes=fetch_min_bytes)
        self._build_steps(accept if accept is not None else accepted_kinds(config.topics, topics))
        self._tasks: dict[tuple[TopicPartition, int], asyncio.Task[None]] = {}
        self._tails: dict[Any, asyncio.Task[None]] = {}
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._fatal: BaseException | None = None
        self._paused = False
        self._started = asyncio.Event()
        self._init_metrics(topics)

    def _build_steps(self, accept: dict[str, tuple[type, ...]]) -> None:
        """The steps each record goes through, and the commit policy (see the module docstring)."""
        self._decoder = Decoder(self.codec, accept)
        self._duplicates = DuplicateFilter(self.dedup)
        self._retries = RetryPolicy(self.config.bus.handler_attempts, self.config.bus.retry_backoff_s)
        self._dead_letters = DeadLetterPolicy(
            self.dlq, self.producer, transactional=self.transaction is not None,
            counted=lambda record: MESSAGES_DEAD_LETTERED.labels(*self._labels, self._logical(record)).inc())
        self._tracker = OffsetTracker()
        self._commits: CommitPolicy = (
            WatermarkCommits(self._tracker, self._consumer, self.dedup, self.group) if self.transaction is None
            else TransactionalCommits(self._tracker, self.transaction, self.group, self._fail))

    def _init_metrics(self, topics: Sequence[str]) -> None:
        """Create every (group, topic) series at 0, so dashboards show "none yet", not "no data"
        (Prometheus' advice for label values known in advance)."""
        for topic in topics:
            labels = (*self._labels, topic)
            MESSAGES_PROCESSED.labels(*labels)
            MESSAGES_DEAD_LETTERED.labels(*labels)
            for reason in FAILURE_REASONS:
                MESSAGES_FAILED.labels(*labels, reason)
            if self.dedup is not None:
                MESSAGES_DEDUPLICATED.labels(*labels)
        IN_FLIGHT.labels(*self._labels).set(0)
        PAUSED.labels(*self._labels).set(0)

    # -- public ---------------------------------------------------------------------------------

    @property
    def assignment(self) -> set[TopicPartition]:
        return self._consumer.assignment()

    @property
    def consumer(self) -> GroupConsumer:
        return self._consumer

    @property
    def in_flight(self) -> int:
        """Records dispatched and not finished (at ``max_in_flight`` the loop pauses)."""
        return len(self._tasks)

    async def wait_started(self) -> None:
        await self._started.wait()

    def stop(self) -> None:
        """Ask the loop to stop gracefully (idempotent, callable from a signal handler)."""
        self._stopping.set()

    async def run(self) -> None:
        """Consume until :meth:`stop`; re-raises a fatal error (e.g. the DLQ rate limit). Stopped
        before it ran, it returns without joining the group."""
        if self._stopping.is_set():
            self._started.set()
            await self._consumer.stop()
            return
        if self.transaction is not None:
            await self.transaction.open()
        self._consumer.subscribe(list(self._physical), listener=self)
        await self._consumer.start()
        self._started.set()
        committer = asyncio.create_task(self._commit_periodically(), name=f"commit-{self.group}")
        try:
            while not self._stopping.is_set():
                await self._poll_once()
        finally:
            committer.cancel()
            health.forget(self.group)
            await self._shutdown()
        if self._fatal is not None:
            raise self._fatal

    def _fail(self, exc: BaseException) -> None:
        """A fatal error: the loop stops, leaving what it concerns uncommitted; run() re-raises it."""
        self._fatal = exc
        self.stop()

    # -- polling and dispatch -------------------------------------------------------------------

    async def _poll_once(self) -> None:
        free = self.max_in_flight - len(self._tasks)
        self._set_paused(free <= 0)
        LOOP_PROGRESS.labels(*self._labels).set(time.time())
        health.beat(self.group)
        if free <= 0:
            # Keep calling getmany (returns nothing while paused) so the group sees us alive.
            self._slot_freed.clear()
            try:
                await wait_for(self._slot_freed.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
            await self._consumer.getmany(timeout_ms=0)
            return
        batch = await self._consumer.getmany(timeout_ms=200, max_records=free)
        for tp, records in batch.items():
            for record in records:
                self._dispatch(tp, record)

    def _set_paused(self, paused: bool) -> None:
        if paused == self._paused:
            return
        assigned = self._consumer.assignment()
        if paused:
            self._consumer.pause(*assigned)
        else:
            self._consumer.resume(*assigned)
        self._paused = paused
        PAUSED.labels(*self._labels).set(1 if paused else 0)

    def _ordering_key(self, tp: TopicPartition, record: ConsumerRecord) -> Any:
        if self.ordering == "none":
            return None
        if self.ordering == "partition" or record.key is None:
            return tp if self.ordering == "partition" else None
        return (tp, record.key)

    def _dispatch(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        self._tracker.dispatch(tp, record.offset)
        if self._tracker.already_done(tp, record.offset):  # finished past the commit by the last owner
            self._tracker.done(tp, record.offset)
            MESSAGES_DEDUPLICATED.labels(*self._labels, self._logical(record)).inc()
            return
        key = self._ordering_key(tp, record)
        predecessor = self._tails.get(key) if key is not None else None
        task = asyncio.create_task(self._process(tp, record, predecessor))
        self._tasks[(tp, record.offset)] = task
        if key is not None:
            self._tails[key] = task
        ident = (tp, record.offset)
        task.add_done_callback(lambda t: self._finished(t, key, ident))
        IN_FLIGHT.labels(*self._labels).set(len(self._tasks))

    def _finished(self, task: asyncio.Task[None], key: Any, ident: tuple[TopicPartition, int]) -> None:
        self._tasks.pop(ident, None)
        if key is not None and self._tails.get(key) is task:
            del self._tails[key]
        IN_FLIGHT.labels(*self._labels).set(len(self._tasks))
        self._slot_freed.set()

    # -- processing one record: the steps -------------------------------------------------------

    async def _process(self, tp: TopicPartition, record: ConsumerRecord, predecessor: asyncio.Task[None] | None) -> None:
        labels = (*self._labels, self._logical(record))
        started = time.perf_counter()
        try:
            if predecessor is not None:
                await asyncio.wait([predecessor])  # order by key; its outcome is its own business
            outputs = await self._process_record(record, labels)
        except asyncio.CancelledError:
            raise  # not done: stays uncommitted and is redelivered to whoever owns the partition next
        except (DeadLetterRateExceeded, NotAuthorized) as exc:  # stop; the message stays uncommitted
            log.error("%s: %s", self.group, exc)
            self._fail(exc)
            return
        except Exception as exc:  # the DLQ itself failed: leave the message uncommitted, stop
            log.exception("cannot dead-letter %s[%d]@%d", record.topic, record.partition, record.offset)
            self._fail(exc)
            return
        HANDLER_LATENCY.labels(*labels).observe(time.perf_counter() - started)
        await self._commits.complete(tp, record.offset, outputs)

    async def _process_record(self, record: ConsumerRecord, labels: tuple[str, ...]) -> list[Output]:
        """Decode, de-duplicate, handle (or dead-letter); returns the outputs a transaction defers."""
        try:
            envelope = self._decoder.decode(record, labels[-1])
        except MessageDecodeError as exc:
            MESSAGES_FAILED.labels(*labels, FAILURE_DECODE).inc()
            return await self._dead_letters.reject(record, f"decode: {exc}", exc.field)
        async with self._duplicates.claim(envelope.message_id) as new:
            if not new:
                MESSAGES_DEDUPLICATED.labels(*labels).inc()
                return []

            def attempt() -> Awaitable[list[Output]]:
                ctx = MessageContext(record=record, topic=labels[-1], producer=self.producer,
                                     deferred=[] if self.transaction is not None else None)
                return handle_with_acks(self.handler, envelope, ctx, client_principal(self.config))

            outcome = await self._retries.run(
                attempt, on_error=lambda exc: MESSAGES_FAILED.labels(*labels, FAILURE_HANDLER).inc())
            if isinstance(outcome, Failed):
                log.warning("%s failed on %s (attempt %d): %s", self.group, envelope.message_id, outcome.attempts,
                            outcome.error)
                return await self._dead_letters.reject(record, outcome.error, "", outcome.notify)
        MESSAGES_PROCESSED.labels(*labels).inc()
        return outcome

    # -- commits, rebalances, shutdown -----------------------------------------------------------

    async def _commit(self, only: set[TopicPartition] | None = None) -> None:
        self._export_lag(await self._commits.commit(only))

    def _export_lag(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        for tp, committed in offsets.items():
            highwater = self._consumer.highwater(tp)
            if highwater is not None:
                topic = self._physical.get(tp.topic, tp.topic)
                CONSUMER_LAG.labels(*self._labels, topic, str(tp.partition)).set(max(0, highwater - committed.offset))

    async def _commit_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.bus.commit_interval_s)
            try:
                await self._commit()
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis or broker hiccup: the next round retries
                log.exception("%s: periodic commit failed", self.group)

    async def _drain(self, tps: set[TopicPartition] | None) -> None:
        tasks = [t for (tp, _), t in list(self._tasks.items()) if tps is None or tp in tps]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """The group takes ``revoked`` away: finish (or give up) their handlers, commit, tell the stage."""
        await self._drain(revoked)
        try:
            await self._commit(revoked)
        except Exception:
            log.exception("%s: commit on revoke failed", self.group)
        self._tracker.forget(revoked)
        if self.on_revoke is not None:
            await self.on_revoke(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Where each partition resumes, and what the last owner finished past that (commit metadata)."""
        committed = await self._consumer.committed(assigned)
        for tp in assigned:
            self._tracker.resume(tp, committed.get(tp))
        if self._paused:
            self._consumer.pause(*assigned)
        if self.on_assign is not None:
            await self.on_assign(assigned)

    async def _shutdown(self) -> None:
        try:
            await self._drain(None)
            # bounded (bus.commit_timeout_s): a client retries a commit while no coordinator answers (a broker
            # electing leaders), and a stopping member must still leave; what it left uncommitted is redone
            await wait_for(self._commit(), self.config.bus.commit_timeout_s)
        except asyncio.TimeoutError:
            log.warning("%s: final commit unanswered after %.0fs: left uncommitted, the next owner redoes it",
                        self.group, self.config.bus.commit_timeout_s)
        except Exception:
            log.exception("%s: final commit failed", self.group)
        finally:
            await self._consumer.stop()
            if self.transaction is not None:
                await self.transaction.close()
            PAUSED.labels(*self._labels).set(0)
            IN_FLIGHT.labels(*self._labels).set(0)

    # -- helpers --------------------------------------------------------------------------------

    def _logical(self, record: ConsumerRecord) -> str:
        topic: str = record.topic
        return self._physical.get(topic, topic)
