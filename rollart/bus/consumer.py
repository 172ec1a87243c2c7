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
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Literal, Sequence

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from rollart import health
from rollart.bus.dedup import Deduplicator
from rollart.bus.dlq import DeadLetterQueue, DeadLetterRateExceeded
from rollart.bus.offsets import OffsetTracker
from rollart.bus.producer import AUTHORIZATION_ERRORS, BusProducer, NotAuthorized, client_principal
from rollart.bus.transaction import Transaction, isolation_level
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs
from rollart.messages import Envelope, MessageDecodeError
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
from rollart.topics import load_catalog, spec_for

FAILURE_DECODE, FAILURE_HANDLER = "decode", "handler"
FAILURE_REASONS = (FAILURE_DECODE, FAILURE_HANDLER)

log = logging.getLogger(__name__)

Ordering = Literal["key", "partition", "none"]
PartitionsCallback = Callable[[set[TopicPartition]], Awaitable[None]]


class PermanentError(Exception):
    """Raised by a handler for a message that can never succeed: dead-letter it without retrying.

    ``notify``: outputs ``(topic, message, key)`` produced with the dead-letter (in its transaction,
    if the loop has one), for a downstream stage that must know the message will not come (the
    trainer, of a trajectory whose reward failed)."""

    def __init__(self, message: str, *, notify: Sequence[tuple[str, Any, str | None]] = ()):
        super().__init__(message)
        self.notify = list(notify)


@dataclass
class MessageContext:
    """What a handler gets besides the message: where it came from and a way to produce."""

    record: ConsumerRecord
    topic: str  # logical topic name
    producer: BusProducer
    acks: list[asyncio.Future[Any]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # physical topics of ``acks``
    # Under a transaction the outputs wait here until the handler returned; the loop then sends them
    # in the transaction that also commits this input's offset (a failed attempt sends nothing).
    deferred: list[tuple[str, Any, dict[str, Any]]] | None = None

    async def produce(self, topic: str, message: Any, *, key: str | bytes | None = None,
                      partition: int | None = None, policy_version: int | None = None) -> None:
        """Produce an output; the loop waits for its ack before the input counts as done."""
        if self.deferred is not None:
            self.deferred.append((topic, message, {"key": key, "partition": partition,
                                                   "policy_version": policy_version}))
            return
        self.acks.append(await self.producer.send(topic, message, key=key, partition=partition,
                                                  policy_version=policy_version))
        self.written.append(self.producer.names.physical(topic))


Handler = Callable[[Envelope, MessageContext], Awaitable[None]]


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no types
    def __init__(self, loop: "ConsumerLoop"):
        self._loop = loop

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._loop._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._loop._on_assigned(set(assigned))


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
        self._accept = accept if accept is not None else self._accept_from_catalog(topics)
        self.dlq = DeadLetterQueue(producer, stage=group, max_per_minute=config.bus.dlq_max_per_minute)
        self._consumer = AIOKafkaConsumer(
            group_id=f"{config.job}.{group}",
            client_id=client_id or f"{config.kafka.client_id}-{group}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=config.bus.fetch_max_wait_ms if fetch_max_wait_ms is None else fetch_max_wait_ms,
            session_timeout_ms=config.bus.session_timeout_ms,
            heartbeat_interval_ms=config.bus.heartbeat_interval_ms,
            max_partition_fetch_bytes=config.bus.max_value_bytes,
            fetch_max_bytes=max(config.bus.max_value_bytes, 52428800),
            isolation_level=isolation_level(config),
            **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap),
        )
        self._tracker = OffsetTracker()
        self._tasks: dict[tuple[TopicPartition, int], asyncio.Task[None]] = {}
        self._tails: dict[Any, asyncio.Task[None]] = {}
        self._active_ids: dict[str, asyncio.Task[Any]] = {}  # message id -> the task handling it
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._fatal: BaseException | None = None
        self._paused = False
        self._started = asyncio.Event()
        self._labels = (config.job, group)
        self._init_metrics(topics)

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
        return set(self._consumer.assignment())

    @property
    def consumer(self) -> AIOKafkaConsumer:
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
        self._consumer.subscribe(list(self._physical), listener=_Rebalance(self))
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
                await asyncio.wait_for(self._slot_freed.wait(), 0.2)
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
            MESSAGES_DEDUPLICATED.labels(*self._labels, self._physical.get(record.topic, record.topic)).inc()
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

    # -- processing one message -----------------------------------------------------------------

    async def _process(self, tp: TopicPartition, record: ConsumerRecord, predecessor: asyncio.Task[None] | None) -> None:
        topic = self._physical.get(record.topic, record.topic)
        labels = (*self._labels, topic)
        started = time.perf_counter()
        try:
            if predecessor is not None:
                await asyncio.wait([predecessor])  # order by key; its outcome is its own business
            outputs = await self._process_record(record, topic, labels)
        except asyncio.CancelledError:
            raise  # not done: stays uncommitted and is redelivered to whoever owns the partition next
        except (DeadLetterRateExceeded, NotAuthorized) as exc:  # stop; the message stays uncommitted
            log.error("%s: %s", self.group, exc)
            self._fatal = exc
            self.stop()
            return
        except Exception as exc:  # the DLQ itself failed: leave the message uncommitted, stop
            log.exception("cannot dead-letter %s[%d]@%d", record.topic, record.partition, record.offset)
            self._fatal = exc
            self.stop()
            return
        HANDLER_LATENCY.labels(*labels).observe(time.perf_counter() - started)
        if self.transaction is None:
            self._tracker.done(tp, record.offset)
        else:
            await self.transaction.add(outputs, lambda: self._tracker.done(tp, record.offset))

    async def _process_record(self, record: ConsumerRecord, topic: str,
                              labels: tuple[str, ...]) -> list[tuple[str, Any, dict[str, Any]]]:
        """Decode, de-duplicate, handle (or dead-letter); returns the outputs a transaction defers."""
        try:
            envelope = self.codec.decode(record.value, record.headers, accept=self._accept.get(topic))
        except MessageDecodeError as exc:
            MESSAGES_FAILED.labels(*labels, FAILURE_DECODE).inc()
            await self._dead_letter(record, labels, f"decode: {exc}", exc.field)
            return []
        message_id = envelope.message_id
        me = asyncio.current_task()
        assert me is not None  # always inside its own task (_process)
        twin = self._active_ids.get(message_id)
        self._active_ids[message_id] = me  # a later copy of this message waits for this task
        try:
            if twin is not None:  # the same message is being handled right now: wait, then it is seen
                await asyncio.wait([twin])
            if self.dedup is not None and await self.dedup.seen(message_id):
                MESSAGES_DEDUPLICATED.labels(*labels).inc()
                return []
            error, outputs = await self._handle_with_retries(envelope, record, topic, labels)
            if error is not None:
                await self._dead_letter(record, labels, error, "")
                outputs = await self._notify(outputs)
            if self.dedup is not None:
                self.dedup.mark(message_id)
        finally:
            if self._active_ids.get(message_id) is me:
                del self._active_ids[message_id]
        if error is None:
            MESSAGES_PROCESSED.labels(*labels).inc()
        return outputs

    async def _handle_with_retries(self, envelope: Envelope, record: ConsumerRecord, topic: str,
                                   labels: tuple[str, ...]) -> tuple[str | None, list[Any]]:
        """Run the handler; returns (None, deferred outputs) on success or (the final error text, [])."""
        attempts = self.config.bus.handler_attempts
        for attempt in range(1, attempts + 1):
            ctx = MessageContext(record=record, topic=topic, producer=self.producer,
                                 deferred=[] if self.transaction is not None else None)
            try:
                await self.handler(envelope, ctx)
                if ctx.acks:
                    await asyncio.gather(*ctx.acks)
                return None, ctx.deferred or []
            except (asyncio.CancelledError, NotAuthorized):
                raise
            except AUTHORIZATION_ERRORS as exc:  # an ack refused by the broker's ACLs
                raise NotAuthorized(client_principal(self.config), sorted(set(ctx.written)), exc) from exc
            except Exception as exc:  # noqa: BLE001 - any handler failure is retried, then dead-lettered
                MESSAGES_FAILED.labels(*labels, FAILURE_HANDLER).inc()
                error = f"handler: {type(exc).__name__}: {exc}"
                if isinstance(exc, PermanentError) or attempt == attempts:
                    log.warning("%s failed on %s (attempt %d): %s", self.group, envelope.message_id, attempt, error)
                    notify = exc.notify if isinstance(exc, PermanentError) else []
                    return error, [(topic, message, {"key": key}) for topic, message, key in notify]
                await asyncio.sleep(self.config.bus.retry_backoff_s * 2 ** (attempt - 1))
        return "unreachable", []  # pragma: no cover

    async def _notify(self, outputs: list[tuple[str, Any, dict[str, Any]]]) -> list[tuple[str, Any, dict[str, Any]]]:
        """A dead-letter's notifications: deferred into the transaction, or produced and acked now."""
        if self.transaction is not None or not outputs:
            return outputs
        await asyncio.gather(*[await self.producer.send(topic, message, **options) for topic, message, options in outputs])
        return []

    async def _dead_letter(self, record: ConsumerRecord, labels: tuple[str, ...], error: str, field: str) -> None:
        await self.dlq.send(record, error, field)
        MESSAGES_DEAD_LETTERED.labels(*labels).inc()

    # -- commits, rebalances, shutdown -----------------------------------------------------------

    async def _commit(self, only: set[TopicPartition] | None = None) -> None:
        if self.transaction is not None:
            await self._commit_transaction()
            return
        offsets = self._tracker.to_commit(only)
        if not offsets:
            return
        if self.dedup is not None:
            await self.dedup.flush()  # marks first: a crash after this point dedups the redelivery
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partitions: the new owner redelivers, dedup absorbs it.
            log.warning("%s: commit failed (%s); messages will be redelivered and de-duplicated", self.group, exc)
            return
        self._tracker.committed(offsets)
        self._export_lag(offsets)

    async def _commit_transaction(self) -> None:
        """Every done input's offset with the outputs sent for it, all or nothing (every partition:
        outputs of the others are in the same transaction). A failed commit is fatal: the loop stops
        uncommitted, and the restarted member redoes the inputs whose transaction was aborted."""
        assert self.transaction is not None  # only transactional loops commit this way
        try:
            offsets = await self.transaction.commit(self._tracker.to_commit)
        except Exception as exc:  # noqa: BLE001 - a record or the commit failed: never commit around it
            log.error("%s: transaction commit failed (%s); stopping, its inputs will be redone", self.group, exc)
            self._fatal = exc
            self.stop()
            return
        if offsets:
            self._tracker.committed(offsets)
            self._export_lag(offsets)

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

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._drain(revoked)
        try:
            await self._commit(revoked)
        except Exception:
            log.exception("%s: commit on revoke failed", self.group)
        self._tracker.forget(revoked)
        if self.on_revoke is not None:
            await self.on_revoke(revoked)

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        # Where each partition resumes, and what the last owner finished past that (commit metadata).
        # The coordinator's own fetch (what consumer.committed() calls) is the one that returns metadata.
        committed = await self._consumer._coordinator.fetch_committed_offsets(list(assigned)) if assigned else {}
        for tp in assigned:
            self._tracker.resume(tp, committed.get(tp))
        if self._paused:
            self._consumer.pause(*assigned)
        if self.on_assign is not None:
            await self.on_assign(assigned)

    async def _shutdown(self) -> None:
        try:
            await self._drain(None)
            await self._commit()
        except Exception:
            log.exception("%s: final commit failed", self.group)
        finally:
            await self._consumer.stop()
            if self.transaction is not None:
                await self.transaction.close()
            PAUSED.labels(*self._labels).set(0)
            IN_FLIGHT.labels(*self._labels).set(0)

    # -- helpers --------------------------------------------------------------------------------

    def _accept_from_catalog(self, topics: Sequence[str]) -> dict[str, tuple[type, ...]]:
        catalog = load_catalog(self.config.topics)
        accept = {}
        for topic in topics:
            try:
                accept[topic] = spec_for(topic, catalog).message_kinds
            except KeyError:
                pass  # not a catalog topic (tests, scratch topics): any registered kind
        return accept
