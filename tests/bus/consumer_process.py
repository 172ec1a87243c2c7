"""A consumer in its own process, for the crash and SIGTERM tests.

argv: bootstrap redis_url job group topic effect_key commit_interval_s handler_delay_s [startup_s]
Each handled message appends its id to the Redis list ``effect_key`` (the handler's side effect)
and prints "handled <n>". With a long commit interval it never commits (crash test: killed -9);
SIGTERM drains in-flight handlers, commits and exits 0. With ``startup_s`` it first starts up like a
generation member loading its engine: a blocking part (vLLM's construction, interruptible) then an
async part (its warm-up), each ``startup_s`` long; SIGTERM then must end it at once and cleanly,
without joining the group.
With $OUTPUT_TOPIC set, each handled message is also produced there (the copy keyed by its id), in
the loop's transaction when ROLLART_BUS_PROCESSING_GUARANTEE=exactly_once.
"""

import asyncio
import os
import sys
import time

from rollart.bus import StopRequest
from rollart.bus.stopping import StartupInterrupted, interruptible
from rollart.config import build_config
from rollart.stages.runner import Member, run_member


async def main(bootstrap: str, redis_url: str, job: str, group: str, topic: str, effect_key: str,
               commit_interval_s: str, handler_delay_s: str, startup_s: str = "0") -> None:
    stop = StopRequest.installed()  # first, as rollart.stages.entry does
    print("starting", flush=True)
    try:
        with interruptible():  # as vLLM's engine constructor runs
            time.sleep(float(startup_s))  # noqa: ASYNC251 - a blocking constructor, as vLLM's is
    except StartupInterrupted:
        print("stopped during start-up", flush=True)
        return
    print("constructed", flush=True)
    if await stop.unless_requested(asyncio.sleep(float(startup_s), result="warm")) is None:
        print("stopped during start-up", flush=True)
        return
    config = build_config({"job": job, "kafka": {"bootstrap": bootstrap}, "redis": {"url": redis_url},
                           "bus": {"commit_interval_s": float(commit_interval_s), "fetch_max_wait_ms": 20,
                                   "session_timeout_ms": 3000, "heartbeat_interval_ms": 300}})
    handled = 0
    output_topic = os.environ.get("OUTPUT_TOPIC")

    def build(rt):
        async def handle(envelope, ctx) -> None:
            nonlocal handled
            print(f"started {envelope.message_id}", flush=True)
            await asyncio.sleep(float(handler_delay_s))
            await rt.redis.rpush(effect_key, envelope.message_id)
            if output_topic:
                await ctx.produce(output_topic, envelope.message, key=envelope.message_id)
            handled += 1
            print(f"handled {handled}", flush=True)

        return Member(loops=[rt.consumer_loop(group, [topic], handle, transactional=bool(output_topic))])

    await run_member(config, stop, build)  # as every stage's member runs
    print("exited cleanly", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
