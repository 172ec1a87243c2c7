"""A consumer process for the crash test: handles messages, never commits, waits to be killed -9.

argv: bootstrap redis_url job group topic effect_key
Each handled message appends its id to the Redis list ``effect_key`` (the handler's side effect)
and prints "handled <n>" so the test knows when to kill it.
"""

import asyncio
import sys

from rollart.config import build_config
from rollart.runtime import open_runtime


async def main(bootstrap: str, redis_url: str, job: str, group: str, topic: str, effect_key: str) -> None:
    config = build_config({"job": job, "kafka": {"bootstrap": bootstrap}, "redis": {"url": redis_url},
                           "bus": {"commit_interval_s": 3600, "fetch_max_wait_ms": 20,
                                   "session_timeout_ms": 3000, "heartbeat_interval_ms": 300}})
    async with open_runtime(config, serve=False) as rt:
        handled = 0

        async def handle(envelope, ctx) -> None:
            nonlocal handled
            await rt.redis.rpush(effect_key, envelope.message_id)
            handled += 1
            print(f"handled {handled}", flush=True)

        await rt.consumer_loop(group, [topic], handle).run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
