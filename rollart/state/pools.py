"""Generation-pool membership: members heartbeat into Redis; silence for ``ttl_s`` means gone.

Each pool is a sorted set (``<prefix>:<job>:pool:<pool>``) of member ids scored by the time their
last heartbeat expires, plus a small hash per member with what it reports (host, model, version).
Env consumers ask for live members to route around a pool that has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator

from redis.asyncio import Redis

from rollart.names import RedisKeys


class PoolRegistry:
    def __init__(self, redis: Redis, *, prefix: str, job: str):
        self.redis = redis
        self._prefix = RedisKeys(prefix, job).pool_prefix

    def _pool_key(self, pool: str) -> str:
        return self._prefix + pool

    def _info_key(self, pool: str, member: str) -> str:
        return f"{self._prefix}{pool}:member:{member}"

    async def heartbeat(self, pool: str, member: str, *, ttl_s: float, info: dict[str, Any] | None = None) -> None:
        expires = time.time() + ttl_s
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(self._pool_key(pool), {member: expires})
            pipe.set(self._info_key(pool, member), json.dumps(info or {}), px=int(ttl_s * 1000))
            await pipe.execute()

    async def leave(self, pool: str, member: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self._pool_key(pool), member)
            pipe.delete(self._info_key(pool, member))
            await pipe.execute()

    async def live_members(self, pool: str) -> list[str]:
        key = self._pool_key(pool)
        now = time.time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(key, "-inf", now)  # prune the dead while we are here
            pipe.zrangebyscore(key, now, "+inf")
            _, members = await pipe.execute()
        return sorted(m.decode() for m in members)

    async def member_info(self, pool: str, member: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self._info_key(pool, member))
        return json.loads(raw) if raw is not None else None

    async def live_infos(self, pool: str) -> dict[str, dict[str, Any]]:
        """Each live member's info (one round trip for all of them)."""
        members = await self.live_members(pool)
        if not members:
            return {}
        raws = await self.redis.mget([self._info_key(pool, m) for m in members])
        return {m: json.loads(raw) for m, raw in zip(members, raws) if raw is not None}

    async def live_pools(self, pools: list[str]) -> dict[str, list[str]]:
        return {pool: await self.live_members(pool) for pool in pools}

    @contextlib.asynccontextmanager
    async def membership(self, pool: str, member: str, *, ttl_s: float = 10.0,
                         info: dict[str, Any] | None = None) -> AsyncIterator[None]:
        """Heartbeat every ``ttl_s / 3`` while the block runs; leave on exit."""
        await self.heartbeat(pool, member, ttl_s=ttl_s, info=info)

        async def beat() -> None:
            while True:
                await asyncio.sleep(ttl_s / 3)
                try:
                    await self.heartbeat(pool, member, ttl_s=ttl_s, info=info)
                except Exception:  # Redis blip: the next beat retries; TTL covers 2 misses
                    pass

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            with contextlib.suppress(Exception):
                await self.leave(pool, member)
