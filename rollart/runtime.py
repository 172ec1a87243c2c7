"""What a stage process holds: config, endpoints, one producer, one Redis client, /metrics.

``open_runtime`` wires them once; ``Runtime.consumer_loop`` builds a consumer loop with the group's
de-duplication and the shared producer. A stage member's lifecycle around them (stop request, start,
ordered stop and drain) is :mod:`rollart.stages.runner`'s.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from redis.asyncio import Redis

from rollart.bus import BusProducer, ConsumerLoop, Deduplicator, Handler
from rollart.bus.transaction import exactly_once, transactional_id
from rollart.config import TANSU_HAS_NO_TRANSACTIONS, ConfigError, RollartConfig
from rollart.endpoints import Endpoints, resolve_endpoints
from rollart.health import HEALTH
from rollart.metrics import serve_metrics
from rollart.state import connect_redis


@dataclass
class Runtime:
    config: RollartConfig
    endpoints: Endpoints
    redis: Redis
    producer: BusProducer
    metrics_port: int | None = None

    def deduplicator(self, group: str) -> Deduplicator:
        return Deduplicator(self.redis, prefix=self.config.redis.key_prefix, job=self.config.job, group=group,
                            ttl_s=self.config.bus.dedup_ttl_s)

    def consumer_loop(self, group: str, topics: Sequence[str], handler: Handler, *, dedup: bool = True,
                      transactional: bool = False, **kwargs: Any) -> ConsumerLoop:
        """``transactional``: a hop that is exactly-once under ``bus.processing_guarantee:
        exactly_once`` (its outputs and input offsets in one transaction); at-least-once otherwise.
        A transactional loop keeps no Redis marks: the transaction is its de-duplication, and a mark
        could outlive the aborted transaction it belonged to and hide the input's redo."""
        txn_id = transactional_id(self.config, group) if transactional else None
        return ConsumerLoop(config=self.config, endpoints=self.endpoints, group=group, topics=topics,
                            handler=handler, producer=self.producer,
                            dedup=self.deduplicator(group) if dedup and txn_id is None else None,
                            transactional_id=txn_id, **kwargs)


@contextlib.asynccontextmanager
async def open_runtime(config: RollartConfig, *, client_id: str | None = None,
                       serve: bool = True) -> AsyncIterator[Runtime]:
    endpoints = resolve_endpoints(config)
    if exactly_once(config) and endpoints.broker == "tansu":
        raise ConfigError(TANSU_HAS_NO_TRANSACTIONS)
    redis = connect_redis(endpoints)
    producer = BusProducer(config, endpoints, client_id=client_id)
    try:
        await producer.start()
        port = None
        if serve and config.metrics.port is not None:
            HEALTH.stall_s = config.metrics.liveness_stall_s
            port = serve_metrics(config.metrics.port, config.metrics.host)
        yield Runtime(config, endpoints, redis, producer, port)
    finally:
        await producer.stop()
        await redis.aclose()

