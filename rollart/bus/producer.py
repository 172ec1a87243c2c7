"""The async producer every stage uses: typed messages in, acknowledged records out."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (ClusterAuthorizationFailedError, TopicAuthorizationFailedError,
                             TransactionalIdAuthorizationFailed)
from aiokafka.structs import RecordMetadata

from rollart.bus.memory import InMemoryBroker
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs
from rollart.messages import DEFAULT_CODEC, Codec
from rollart.metrics import PRODUCED
from rollart.topics import TopicNames


# The broker's ACLs refuse the client: a deployment error, never the message's fault.
AUTHORIZATION_ERRORS = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError,
                        TransactionalIdAuthorizationFailed)


class NotAuthorized(Exception):
    """Writing ``topics`` is not allowed to ``principal``. Consumer loops stop on it without
    committing the input (nothing is lost; a fixed ACL lets the restarted stage redo it) instead of
    dead-lettering message after message."""

    def __init__(self, principal: str, topics: Sequence[str], cause: BaseException):
        self.principal, self.topics = principal, tuple(topics)
        super().__init__(f"{principal} is not authorized to write topic(s) {', '.join(self.topics)} "
                         f"({type(cause).__name__}); grant the stage's ACLs (rollart.topics.access lists them)")


def client_principal(config: RollartConfig) -> str:
    """The principal the broker sees for this client's SASL user (or that there is none)."""
    if config.kafka.security_protocol.startswith("SASL") and config.kafka.sasl_username:
        return f"User:{config.kafka.sasl_username}"
    return f"the {config.kafka.security_protocol} client (no SASL user)"


def _backend_producer(config: RollartConfig, endpoints: Endpoints, client_id: str | None,
                      transactional_id: str | None) -> Any:
    """aiokafka's producer, or the in-memory broker's (which has the part of its API used here)."""
    if endpoints.broker == "memory":
        return InMemoryBroker.at(endpoints.kafka_bootstrap).producer()
    return AIOKafkaProducer(
        client_id=client_id or f"{config.kafka.client_id}-producer",
        acks="all",
        enable_idempotence=bool(transactional_id) or (config.bus.idempotent_producer and endpoints.broker == "kafka"),
        transactional_id=transactional_id,
        linger_ms=config.bus.linger_ms,
        max_request_size=config.kafka.max_request_bytes,
        **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap),
    )


class BusProducer:
    """Encodes messages with the codec, prefixes topics with the job, and reports acks.

    ``send`` returns once the record is queued and gives back a future that resolves when the broker
    has acknowledged it (acks=all): callers that must not lose the message await that future before
    committing what caused it.
    """

    def __init__(self, config: RollartConfig, endpoints: Endpoints, *, codec: Codec = DEFAULT_CODEC,
                 client_id: str | None = None, transactional_id: str | None = None):
        self.config = config
        self.codec = codec
        self.names = TopicNames(config.job)
        self.transactional_id = transactional_id
        self._producer = _backend_producer(config, endpoints, client_id, transactional_id)
        self._started = False

    async def start(self) -> "BusProducer":
        if not self._started:
            await self._producer.start()
            self._started = True
        return self

    async def stop(self) -> None:
        if self._started:
            self._started = False
            await self._producer.stop()  # flushes what is queued

    async def __aenter__(self) -> "BusProducer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # -- transactions (a producer made with a transactional_id) ----------------------------------

    async def begin_transaction(self) -> None:
        await self._producer.begin_transaction()

    async def commit_transaction(self, offsets: dict[Any, Any], group_id: str) -> None:
        """Commit what was sent since :meth:`begin_transaction` together with the consumer
        ``offsets`` of ``group_id`` (all or nothing)."""
        if offsets:
            await self._producer.send_offsets_to_transaction(offsets, group_id)
        await self._producer.commit_transaction()

    async def send(self, topic: str, message: Any, *, key: str | bytes | None = None, partition: int | None = None,
                   policy_version: int | None = None) -> "asyncio.Future[RecordMetadata]":
        """Queue ``message`` on the logical ``topic``; the returned future resolves on broker ack."""
        headers, value = self.codec.encode(message, job=self.config.job, policy_version=policy_version)
        return await self.send_raw(self.names.physical(topic), value, key=key, headers=headers, partition=partition)

    async def send_and_wait(self, topic: str, message: Any, **kwargs: Any) -> RecordMetadata:
        return await (await self.send(topic, message, **kwargs))

    async def send_raw(self, physical_topic: str, value: bytes | None, *, key: str | bytes | None = None,
                       headers: Sequence[tuple[str, bytes]] = (), partition: int | None = None,
                       ) -> "asyncio.Future[RecordMetadata]":
        if isinstance(key, str):
            key = key.encode()
        try:
            future = await self._producer.send(physical_topic, value, key=key, headers=list(headers),
                                               partition=partition)
        except AUTHORIZATION_ERRORS as exc:
            raise NotAuthorized(client_principal(self.config), [physical_topic], exc) from exc
        future.add_done_callback(self._count_ack(physical_topic))
        return future  # type: ignore[no-any-return]  # aiokafka ships no types

    def _count_ack(self, physical_topic: str) -> Callable[["asyncio.Future[RecordMetadata]"], None]:
        def done(fut: "asyncio.Future[RecordMetadata]") -> None:
            if not fut.cancelled() and fut.exception() is None:
                PRODUCED.labels(self.config.job, physical_topic).inc()
        return done
