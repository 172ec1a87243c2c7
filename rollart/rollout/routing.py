"""Hardware affinity: a task tag goes to its pool; a pool with no live members is routed around.

Config maps tags to pools (``tags.<tag>.pool``, default ``routing.default_pool``), and the
``hw_mapping`` decorator (see :mod:`rollart.decorators`) declares the same in code. Liveness comes
from the pool registry's heartbeats, cached for ``routing.live_check_interval_s``.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter

from rollart.config import RollartConfig
from rollart.rollout.direct import DIRECT_INFO_KEY
from rollart.state import PoolRegistry

WAITING_CHECK_S = 0.1  # how stale a view of the live pools may be while no pool is live

FALLBACKS = Counter("rollart_env_pool_fallbacks_total",
                    "Requests sent to another pool because the tag's pool had no live members",
                    ("job", "tag", "from_pool", "to_pool"))


def init_fallback_metrics(config: RollartConfig) -> None:
    """A series per (tag, its pool, each other pool) at 0 from the start."""
    for tag in config.tags:
        preferred = config.pool_for(tag)
        for pool in config.pools:
            if pool != preferred:
                FALLBACKS.labels(config.job, tag, preferred, pool)


class PoolRouter:
    def __init__(self, config: RollartConfig, registry: PoolRegistry):
        self.config = config
        self.registry = registry
        self._live: dict[str, bool] = {}
        self._direct: dict[str, list[str]] = {}  # pool -> its live members' direct addresses
        self.refreshes = 0  # of the direct addresses
        self._checked = 0.0

    async def _refresh(self, max_age_s: float) -> None:
        if time.monotonic() - self._checked < max_age_s:
            return
        if self.config.generation.transport == "direct":
            infos = {pool: await self.registry.live_infos(pool) for pool in self.config.pools}
            self._live = {pool: bool(members) for pool, members in infos.items()}
            self._direct = {pool: sorted(info[DIRECT_INFO_KEY] for info in members.values() if DIRECT_INFO_KEY in info)
                            for pool, members in infos.items()}
            self.refreshes += 1
        else:
            live = await self.registry.live_pools(self.config.pools)
            self._live = {pool: bool(members) for pool, members in live.items()}
        self._checked = time.monotonic()

    def all_direct_addresses(self) -> set[str]:
        return {address for addresses in self._direct.values() for address in addresses}

    def direct_addresses(self, pool: str) -> list[str]:
        """The direct addresses the pool's live members advertised (at the last refresh)."""
        return self._direct.get(pool, [])

    async def pool_for(self, tag: str, *, wait_s: float = 0.0, evaluation: bool = False) -> str:
        """The tag's pool if it has live members, else a live pool (counted as a fallback). When no
        pool is live, wait up to ``wait_s`` for one (engines still loading, a pool restarting) rather
        than start a generation timeout against nobody; after that, the preferred pool. The eval pool
        (``eval.pool``) serves eval tasks (``evaluation``) only, and they no other pool: it holds the
        version being evaluated, the others the latest."""
        eval_pool = self.config.eval.pool if self.config.eval is not None else None
        preferred = eval_pool if evaluation else self.config.pool_for(tag)
        fallbacks = [] if evaluation else [p for p in self.config.pools if p != eval_pool]
        deadline = time.monotonic() + wait_s
        max_age_s = interval_s = self.config.routing.live_check_interval_s
        while True:
            await self._refresh(max_age_s)
            if self._live.get(preferred, False):
                return preferred
            for pool in fallbacks:
                if self._live.get(pool):
                    FALLBACKS.labels(self.config.job, tag, preferred, pool).inc()
                    return pool
            if time.monotonic() >= deadline:
                return preferred  # queue on the preferred pool until it comes up
            # Waiting (engines loading at a run's start, a pool restarting): look again sooner, so the
            # first turns leave as the pool comes up, not up to an interval later (one Redis read per
            # look: the waiting trajectories share it).
            max_age_s = min(WAITING_CHECK_S, interval_s)
            await asyncio.sleep(max_age_s)
