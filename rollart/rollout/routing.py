"""Hardware affinity: a task tag goes to its pool; a pool with no live members is routed around.

Config maps tags to pools (``tags.<tag>.pool``, default ``routing.default_pool``), and the
``hw_mapping`` decorator (see :mod:`rollart.decorators`) declares the same in code. Liveness comes
from the pool registry's heartbeats, cached for ``routing.live_check_interval_s``.
"""

from __future__ import annotations

import time

from prometheus_client import Counter

from rollart.config import RollartConfig
from rollart.state import PoolRegistry

FALLBACKS = Counter("rollart_env_pool_fallbacks_total",
                    "Requests sent to another pool because the tag's pool had no live members",
                    ("job", "tag", "from_pool", "to_pool"))


class PoolRouter:
    def __init__(self, config: RollartConfig, registry: PoolRegistry):
        self.config = config
        self.registry = registry
        self._live: dict[str, bool] = {}
        self._checked = 0.0

    async def _refresh(self) -> None:
        if time.monotonic() - self._checked < self.config.routing.live_check_interval_s:
            return
        live = await self.registry.live_pools(self.config.pools)
        self._live = {pool: bool(members) for pool, members in live.items()}
        self._checked = time.monotonic()

    async def pool_for(self, tag: str) -> str:
        preferred = self.config.pool_for(tag)
        await self._refresh()
        if self._live.get(preferred, False):
            return preferred
        for pool in self.config.pools:
            if self._live.get(pool):
                FALLBACKS.labels(self.config.job, tag, preferred, pool).inc()
                return pool
        return preferred  # nothing is live: queue on the preferred pool until it comes up
