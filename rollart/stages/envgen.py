"""An env member and a generation member of one pool in one process: each turn a function call.

Between two processes a turn costs each side a wake-up of its event loop, a frame and the codec, about
0.1 ms of CPU a side on a small machine (README, "How a rollout flows"): on 2 cores that was most of
what the pipeline spent beyond the engine and the trainer. Here the env member's direct client finds
the generation member's server in its own process (``DirectClient.serve_here``) and awaits its
handler as a coroutine; everything else is as the two stages run apart: the same consumer groups
(``env``, ``env-actions``, ``gen-<pool>``), the same registry membership (other env members reach this
generation member over its socket, and this env member reaches other pools' members over theirs), the
same bus fallback. One member of each, sharing the runtime (producer, Redis, metrics endpoint).

``env.colocate_pool`` makes the local runners start these in place of the env members and that pool's
generation members (``rollart deploy render``: a Deployment of them in place of both, with the pool's
hardware).
"""

from __future__ import annotations

import dataclasses
import os
import socket

from rollart.bus import StopRequest
from rollart.config import RollartConfig
from rollart.rollout.chat import ChatFormat
from rollart.runtime import Runtime
from rollart.stages.env import EnvManager, env_member, init_metrics
from rollart.stages.generation import generation_member, generation_stage, member_id, start_engine
from rollart.stages.runner import Member, run_member


def colocated(upstream: Member, downstream: Member) -> Member:
    """Two members as one: ``upstream``'s loops stop (and drain) before ``downstream``'s, whose replies
    they wait on; what they hold and run in the background together, cleaned up in that order."""
    return dataclasses.replace(upstream, loops=(*upstream.loops, *downstream.loops),
                               background=(*upstream.background, *downstream.background),
                               holding=(*downstream.holding, *upstream.holding),
                               cleanup=(*upstream.cleanup, *downstream.cleanup))


async def run_envgen(config: RollartConfig, stop: StopRequest, *, pool: str, engine=None) -> None:
    """Run an env member and a generation member of ``pool`` in this process until ``stop``."""
    from rollart.models.tiny import ensure_model

    if config.env.colocate_pool is None:
        raise ValueError("envgen runs an env member inside a generation member of env.colocate_pool, which "
                         "this job does not set")
    if pool != config.env.colocate_pool:
        raise ValueError(f"--pool {pool!r}: envgen serves env.colocate_pool, {config.env.colocate_pool!r}")
    model = ensure_model(config.model)
    if engine is None:
        from rollart.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(model, config.generation)
    chat = ChatFormat.from_pretrained(model)
    init_metrics(config)
    member = member_id(pool)
    try:
        if not await start_engine(engine, stop):
            return

        def build(rt: Runtime) -> Member:
            generation = generation_stage(rt, engine, pool, member)
            serving = generation_member(generation)  # binds its direct server
            env = EnvManager(rt, chat, f"env-{socket.gethostname()}-{os.getpid()}")
            assert env.direct is not None and generation.direct is not None  # the config asks for direct
            env.direct.serve_here(generation.direct)
            return colocated(env_member(env), serving)

        await run_member(config, stop, build, client_id=member)
    finally:
        engine.shutdown()
