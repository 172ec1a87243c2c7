"""Redis connections (redis-py asyncio). Every key lives under ``<prefix>:<job>:``."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis

from rollart.endpoints import Endpoints


def connect_redis(endpoints: Endpoints, *, timeout_s: float = 5.0) -> Redis:
    """A client for the configured Redis: TLS with a ``rediss://`` URL, auth and certificates from
    ``redis.*`` config (``endpoints.redis_options``) or the URL (``rediss://user:pass@host``)."""
    # A blocking pool: a burst of concurrent handlers waits for a connection instead of failing.
    pool = BlockingConnectionPool.from_url(endpoints.redis_url, max_connections=64, timeout=timeout_s,
                                           socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           health_check_interval=30, **endpoints.redis_options)
    return Redis.from_pool(pool)  # the client owns the pool: aclose() closes it
