"""Pool membership: heartbeats keep a member live, silence for the TTL removes it."""

from __future__ import annotations

import asyncio

from rollart.state import PoolRegistry
from tests.conftest import eventually


def _registry(runtime) -> PoolRegistry:
    return PoolRegistry(runtime.redis, prefix=runtime.config.redis.key_prefix, job=runtime.config.job)


async def test_members_expire_without_heartbeats(runtime):
    pools = _registry(runtime)
    await pools.heartbeat("h20", "gen-0", ttl_s=0.5, info={"model": "tiny"})
    await pools.heartbeat("h20", "gen-1", ttl_s=30)
    assert await pools.live_members("h20") == ["gen-0", "gen-1"]
    assert await pools.member_info("h20", "gen-0") == {"model": "tiny"}
    assert await pools.live_members("h800") == []
    await eventually(lambda: _members(pools, "h20", ["gen-1"]), timeout=5, what="gen-0 to expire")
    await pools.leave("h20", "gen-1")
    assert await pools.live_members("h20") == []


async def _members(pools, pool, expected):
    return await pools.live_members(pool) == expected


async def test_membership_context_heartbeats_and_leaves(runtime):
    pools = _registry(runtime)
    async with pools.membership("h800", "gen-7", ttl_s=0.6):
        await asyncio.sleep(1.5)  # longer than the TTL: only heartbeats keep it live
        assert await pools.live_members("h800") == ["gen-7"]
        assert await pools.live_pools(["h800", "h20"]) == {"h800": ["gen-7"], "h20": []}
    assert await pools.live_members("h800") == []
