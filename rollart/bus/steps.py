"""The steps one record goes through in a consumer loop, each small and tested on its own.

In the spirit of arroyo's processing strategies: :class:`~rollart.bus.consumer.ConsumerLoop` fetches,
orders and dispatches records, and composes these steps for each one:

1. :class:`Decoder`: bytes and headers to an envelope of a kind the topic accepts (or a decode error,
   which goes to the DLQ);
2. :class:`DuplicateFilter`: a copy of a message being handled right now waits for it; a message the
   group already processed is skipped (Redis marks, where the loop de-duplicates);
3. :class:`RetryPolicy` around :func:`handle_with_acks`: the handler runs, and its outputs must be
   acknowledged before the attempt counts (ack-gated completion); failures are retried with
   exponential backoff, a :class:`PermanentError` at once to the DLQ;
4. :class:`DeadLetterPolicy`: the record to the DLQ (rate-limited), then the failure's notifications;
5. a commit policy (:mod:`rollart.bus.commits`): the input is done, its offset committed later.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from rollart.bus.backend import ConsumerRecord
from rollart.bus.dedup import Deduplicator
from rollart.bus.dlq import DeadLetterQueue
from rollart.bus.producer import AUTHORIZATION_ERRORS, BusProducer, NotAuthorized
from rollart.messages import Codec, Envelope
from rollart.topics import load_catalog, spec_for

T = TypeVar("T")
Output = tuple[str, Any, dict[str, Any]]  # (logical topic, message, BusProducer.send keywords)


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
    deferred: list[Output] | None = None

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


class Decoder:
    """Decode a record, accepting only the message kinds its topic carries (``accept``: logical topic
    -> kinds; a topic not in it accepts any registered kind). Raises MessageDecodeError."""

    def __init__(self, codec: Codec, accept: dict[str, tuple[type, ...]]):
        self.codec = codec
        self.accept = accept

    def decode(self, record: ConsumerRecord, topic: str) -> Envelope:
        return self.codec.decode(record.value, record.headers, accept=self.accept.get(topic))


def accepted_kinds(catalog_dir: Path | None, topics: Sequence[str]) -> dict[str, tuple[type, ...]]:
    """The message kinds each of ``topics`` carries, as the topic catalog (``config.topics``) says."""
    catalog = load_catalog(catalog_dir)
    accept = {}
    for topic in topics:
        try:
            accept[topic] = spec_for(topic, catalog).message_kinds
        except KeyError:
            pass  # not a catalog topic (tests, scratch topics): any registered kind
    return accept


class DuplicateFilter:
    """At most one task handles a message id at a time, and (with a Deduplicator) once per group."""

    def __init__(self, dedup: Deduplicator | None):
        self.dedup = dedup
        self._active: dict[str, asyncio.Task[Any]] = {}  # message id -> the task handling it

    @contextlib.asynccontextmanager
    async def claim(self, message_id: str) -> AsyncIterator[bool]:
        """Yields whether the message is new. A copy being handled by another task is waited for
        first (all of that task: its commit bookkeeping too), then looked up like any other. A new
        message is marked processed when the block exits normally."""
        me = asyncio.current_task()
        assert me is not None  # always inside a task of its own
        twin = self._active.get(message_id)
        self._active[message_id] = me  # a later copy of this message waits for this task
        try:
            if twin is not None:
                await asyncio.wait([twin])
            if self.dedup is not None and await self.dedup.seen(message_id):
                yield False
                return
            yield True
            if self.dedup is not None:
                self.dedup.mark(message_id)
        finally:
            if self._active.get(message_id) is me:
                del self._active[message_id]


async def handle_with_acks(handler: Handler, envelope: Envelope, ctx: MessageContext, principal: str) -> list[Output]:
    """One attempt: the handler, then the broker's acks of everything it produced (an input is done
    only once its outputs are on the log). Returns the outputs a transaction defers. A refusal by the
    broker's ACLs is a deployment error, raised as NotAuthorized (never retried or dead-lettered)."""
    try:
        await handler(envelope, ctx)
        if ctx.acks:
            await asyncio.gather(*ctx.acks)
    except AUTHORIZATION_ERRORS as exc:
        raise NotAuthorized(principal, sorted(set(ctx.written)), exc) from exc
    return ctx.deferred or []


@dataclass(frozen=True)
class Failed:
    """Every attempt failed (or one failed permanently): what to dead-letter, and whom to tell."""

    error: str
    attempts: int
    notify: list[Output] = field(default_factory=list)


class RetryPolicy:
    """``attempts`` tries with exponential backoff from ``backoff_s``; a PermanentError is not retried.
    Cancellation and NotAuthorized pass through (the message stays uncommitted)."""

    def __init__(self, attempts: int, backoff_s: float):
        self.attempts = attempts
        self.backoff_s = backoff_s

    def backoff(self, attempt: int) -> float:
        return self.backoff_s * 2.0 ** (attempt - 1)

    async def run(self, attempt_once: Callable[[], Awaitable[T]],
                  on_error: Callable[[Exception], None] = lambda exc: None) -> T | Failed:
        for attempt in range(1, self.attempts + 1):
            try:
                return await attempt_once()
            except NotAuthorized:
                raise
            except Exception as exc:  # noqa: BLE001 - any handler failure is retried, then dead-lettered
                on_error(exc)
                if isinstance(exc, PermanentError) or attempt == self.attempts:
                    notify = exc.notify if isinstance(exc, PermanentError) else []
                    return Failed(f"handler: {type(exc).__name__}: {exc}", attempt,
                                  [(topic, message, {"key": key}) for topic, message, key in notify])
                await asyncio.sleep(self.backoff(attempt))
        raise AssertionError("unreachable: the last attempt returns")  # pragma: no cover


class DeadLetterPolicy:
    """A failed record goes to its topic's DLQ (rate-limited: DeadLetterRateExceeded stops the loop),
    then its notifications go out: deferred into the loop's transaction, or produced and acked now."""

    def __init__(self, dlq: DeadLetterQueue, producer: BusProducer, *, transactional: bool,
                 counted: Callable[[ConsumerRecord], None] = lambda record: None):
        self.dlq = dlq
        self.producer = producer
        self.transactional = transactional
        self.counted = counted

    async def reject(self, record: ConsumerRecord, error: str, field: str = "",
                     notify: Sequence[Output] = ()) -> list[Output]:
        """Returns the notifications left for the transaction to send ([] without one)."""
        await self.dlq.send(record, error, field)
        self.counted(record)
        if self.transactional or not notify:
            return list(notify)
        acks = [await self.producer.send(topic, message, **options) for topic, message, options in notify]
        await asyncio.gather(*acks)
        return []
