"""De-duplication by message id, shared by the members of one consumer group.

A message is a duplicate when a message with the same deterministic id was already processed by
the group: either redelivered (a member died after processing, before committing) or produced twice
(an upstream stage died after producing, before committing, and produced it again at a new offset).

Ids are remembered in Redis with a TTL (:meth:`RedisKeys.dedup_prefix` + id) and in a per-process
LRU. Marks are written to Redis as soon as a handler finishes (coalesced into one pipeline per
event-loop tick), and the consumer loop waits for them before it commits the offsets they cover, so
a member killed after processing but before committing leaves marks for every message it finished:
its successor skips them. Only a kill inside the ~1 ms between a handler's end and its mark reaching
Redis repeats the handler, and its outputs then carry the same ids, so the next stage drops them.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Awaitable, Callable, Iterable, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollart.names import RedisKeys

T = TypeVar("T")
REDIS_ATTEMPTS = 4  # a Redis blip of about a second is absorbed; longer, and the consumer stops


class Deduplicator:
    def __init__(self, redis: Redis, *, prefix: str, job: str, group: str, ttl_s: int, local_capacity: int = 100_000):
        self.redis = redis
        self.ttl_s = ttl_s
        self._key_prefix = RedisKeys(prefix, job).dedup_prefix(group)
        self._local: OrderedDict[str, None] = OrderedDict()
        self._capacity = local_capacity
        self._unflushed: list[str] = []
        self._queries: list[tuple[str, asyncio.Future[bool]]] = []
        self._query_task: asyncio.Task[None] | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()

    def _key(self, message_id: str) -> str:
        return self._key_prefix + message_id

    def _remember(self, message_id: str) -> None:
        self._local[message_id] = None
        self._local.move_to_end(message_id)
        if len(self._local) > self._capacity:
            self._local.popitem(last=False)

    async def seen(self, message_id: str) -> bool:
        """Was this id processed by the group? Concurrent calls share one Redis round trip."""
        if message_id in self._local:
            return True
        future = asyncio.get_running_loop().create_future()
        self._queries.append((message_id, future))
        if self._query_task is None:
            self._query_task = asyncio.create_task(self._answer_queries())
        return bool(await future)

    async def _answer_queries(self) -> None:
        await asyncio.sleep(0)  # let the handlers dispatched in this poll join the batch
        try:
            while self._queries:
                batch, self._queries = self._queries, []
                ids = [message_id for message_id, _ in batch]
                try:
                    found = await _with_retries(lambda: self._exists(ids))  # noqa: B023 - awaited here
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (message_id, future), hit in zip(batch, found):
                    if hit:
                        self._remember(message_id)
                    if not future.done():
                        future.set_result(bool(hit))
        finally:
            self._query_task = None

    async def _exists(self, ids: Iterable[str]) -> list[int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for message_id in ids:
                pipe.exists(self._key(message_id))
            return await pipe.execute()

    def mark(self, message_id: str) -> None:
        """Record a processed id; it is written to Redis right away, in the background."""
        self._remember(message_id)
        self._unflushed.append(message_id)
        if self._flush_task is None:
            self._flush_task = asyncio.create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        try:
            while self._unflushed:
                await asyncio.sleep(0)  # coalesce the marks of handlers finishing in the same tick
                try:
                    await self.flush()
                except Exception:
                    return  # kept in _unflushed; the commit's flush retries and surfaces the error
        finally:
            self._flush_task = None

    async def flush(self) -> None:
        """Write every pending mark; returns when they are all in Redis (waits for one in progress)."""
        async with self._flush_lock:
            if not self._unflushed:
                return
            ids, self._unflushed = self._unflushed, []
            try:
                await _with_retries(lambda: self._set_all(ids))
            except BaseException:
                self._unflushed[:0] = ids  # keep them for the next attempt
                raise

    async def _set_all(self, ids: list[str]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for message_id in ids:
                pipe.set(self._key(message_id), b"1", ex=self.ttl_s)
            await pipe.execute()


async def _with_retries(call: Callable[[], Awaitable[T]]) -> T:
    for attempt in range(REDIS_ATTEMPTS):
        try:
            return await call()
        except (RedisConnectionError, RedisTimeoutError):
            if attempt == REDIS_ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.1 * 2 ** attempt)
    raise AssertionError("unreachable: the last attempt returns or raises")
