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


async def test_a_turn_waiting_for_its_pool_leaves_soon_after_the_pool_comes_up(runtime):
    """At a run's start the engines load for a while: a waiting turn looks again every 0.1 s, not
    every ``routing.live_check_interval_s`` (that cached view is for pools already live)."""
    from rollart.config import RoutingConfig
    from rollart.rollout.routing import PoolRouter

    config = runtime.config.model_copy(update={"routing": RoutingConfig(live_check_interval_s=30.0)})
    pool, pools = config.pools[0], _registry(runtime)
    router = PoolRouter(config, pools)
    waiting = [asyncio.create_task(router.pool_for("any-tag", wait_s=60)) for _ in range(3)]
    await asyncio.sleep(0.5)
    assert not any(task.done() for task in waiting), "no pool is live yet: the turns wait"
    await pools.heartbeat(pool, "gen-0", ttl_s=30)
    try:
        done, _ = await asyncio.wait(waiting, timeout=10)  # a third of the interval: only the fast look does it
        assert [task.result() for task in done] == [pool] * 3
    finally:
        await pools.leave(pool, "gen-0")
        for task in waiting:
            task.cancel()
