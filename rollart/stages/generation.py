"""The generation stage: one consumer group per pool, each member driving one engine.

Requests from ``gen.requests.<pool>`` are handed to the engine as they arrive (up to
``generation.max_concurrency`` at once; vLLM batches them continuously). Results go to the owner's
reply partition of ``env.actions``. An Abort for a trajectory cancels its running request. Members
heartbeat into the pool registry so env consumers can route around a pool with no live members. A
pool follows the trainer's versions (:mod:`rollart.weights.follower`), except the eval pool: it holds
the version its requests are pinned to (:mod:`rollart.evaluation.pinning`).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from typing import get_args

from prometheus_client import Counter, Gauge, Histogram

from rollart.bus import MessageContext, PermanentError, StopRequest
from rollart.bus.stopping import StartupInterrupted
from rollart.config import RollartConfig
from rollart.evaluation.pinning import PinnedWeights
from rollart.messages import Abort, Envelope, GenerationRequest, GenerationResult
from rollart.messages.kinds import FinishReason
from rollart.runtime import Runtime
from rollart.state import PoolRegistry
from rollart.weights.follower import WeightFollower
from rollart.names import ENV_ACTIONS, REWARDS_JUDGE, gen_requests
from rollart.rollout.direct import DIRECT_INFO_KEY, DirectServer
from rollart.stages.runner import Member, Service, run_member

log = logging.getLogger(__name__)

TOKENS = Counter("rollart_generation_tokens_total", "Tokens generated", ("job", "pool"))
REQUESTS = Counter("rollart_generation_requests_total", "Requests finished, by finish reason",
                   ("job", "pool", "finish_reason"))
ABORTS = Counter("rollart_generation_aborts_total", "Abort messages that cancelled a running request",
                 ("job", "pool"))
LATENCY = Histogram("rollart_generation_request_latency_seconds", "Time to generate one turn", ("job", "pool"),
                    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
RUNNING = Gauge("rollart_generation_running_requests", "Requests inside the engine", ("job", "pool"))


REPLY_TOPICS = frozenset({ENV_ACTIONS, REWARDS_JUDGE})  # where a request may ask for its result
FINISH_REASONS = get_args(FinishReason)


def member_id(pool: str) -> str:
    return f"gen-{pool}-{socket.gethostname()}-{os.getpid()}"


class GenerationStage:
    def __init__(self, runtime: Runtime, engine, pool: str, member: str, follower=None, pins=None):
        self.runtime = runtime
        self.engine = engine
        self.follower = follower  # a WeightFollower, or None when the pool serves fixed weights
        self.pins = pins  # the eval pool's PinnedWeights (requests with exact_version), else None
        self.pool = pool
        self.member = member
        self.labels = (runtime.config.job, pool)
        # Bound once: a labels() lookup per metric per turn was ~2% of the member's CPU (py-spy).
        self.tokens, self.latency = TOKENS.labels(*self.labels), LATENCY.labels(*self.labels)
        self.running = RUNNING.labels(*self.labels)
        self.finished = {reason: REQUESTS.labels(*self.labels, reason) for reason in FINISH_REASONS}
        self.direct: DirectServer | None = None

    def membership(self):
        """Heartbeat into the pool registry while the block runs."""
        config = self.runtime.config
        registry = PoolRegistry(self.runtime.redis, prefix=config.redis.key_prefix, job=config.job)
        info = {"model": str(config.model.path), "pid": os.getpid()}
        if self.direct is not None:
            info[DIRECT_INFO_KEY] = self.direct.address
        return registry.membership(self.pool, self.member, ttl_s=config.generation.heartbeat_ttl_s, info=info)

    def direct_server(self) -> DirectServer:
        """The direct turn path's server (``generation.transport: direct``), bound now: its address
        goes into the membership info."""
        gen = self.runtime.config.generation
        self.direct = DirectServer(self.serve, self.cancel, bind_host=gen.direct_bind_host, port=gen.direct_port,
                                   advertise=gen.direct_advertise_host, max_in_flight=gen.max_concurrency,
                                   labels=self.labels)
        return self.direct

    async def handle(self, envelope: Envelope, ctx: MessageContext) -> None:
        """The bus path: an Abort cancels; a request's result goes to its reply partition."""
        message = envelope.message
        if isinstance(message, Abort):
            await self.cancel(message)
            return
        assert isinstance(message, GenerationRequest)
        if message.reply_topic not in REPLY_TOPICS:
            raise PermanentError(f"reply_topic {message.reply_topic!r} is not one of {sorted(REPLY_TOPICS)}")
        result = await self.serve(message)
        if result is None:
            return  # the owner gave the trajectory up; nobody waits for this
        version = result.versions[0] if len(result.versions) else None
        await ctx.produce(message.reply_topic, result, key=message.traj_id, partition=message.reply_partition,
                          policy_version=version)

    async def cancel(self, message: Abort) -> None:
        if await self.engine.abort_trajectory(message.traj_id, message.episode):
            ABORTS.labels(*self.labels).inc()

    async def serve(self, message: GenerationRequest) -> GenerationResult | None:
        """Generate one turn (either path), under the pinned version or at least the one it asks for;
        None if it was aborted."""
        if message.exact_version is not None:
            if self.pins is None:
                raise PermanentError(f"a request pinned to version {message.exact_version} reached pool {self.pool}, "
                                     "which follows the training versions (only eval.pool serves pinned requests)")
            async with self.pins.serving(message.exact_version):
                result = await self._generate(message)
        else:
            if self.follower is not None and message.min_version > self.engine.version:
                await self.follower.wait_for(message.min_version)
            result = await self._generate(message)
        result = replace(result, pool=self.pool, instance=self.member)
        self.finished[result.finish_reason].inc()
        if result.finish_reason == "abort":
            return None
        self.tokens.inc(len(result.token_ids))
        self.latency.observe(result.latency_s)
        return result

    async def _generate(self, message: GenerationRequest):
        self.running.inc()
        try:
            return await self.engine.generate(message)
        finally:
            self.running.dec()


def generation_loop(rt: Runtime, stage: GenerationStage):
    """No Redis de-duplication on this per-turn loop: a copy of a request is generated again and its
    result is an orphan at the env (replies are matched by request), and marks land only once a request
    finished, so after a crash they would spare at most the last commit interval's requests, at the price
    of two Redis round trips on every turn."""
    config = rt.config
    return rt.consumer_loop(f"gen-{stage.pool}", [gen_requests(stage.pool)], stage.handle, ordering="none",
                            dedup=False,
                            max_in_flight=config.generation.max_concurrency,
                            fetch_max_wait_ms=config.generation.turn_fetch_max_wait_ms())


async def run_generation(config: RollartConfig, stop: StopRequest, *, pool: str, engine=None) -> None:
    """Run one generation consumer of ``pool`` until ``stop`` (SIGTERM); a stop during the engine's
    start-up skips its warm-up and joins no group."""
    if pool not in config.pools:
        raise ValueError(f"pool {pool!r} is not one of the job's pools {config.pools}")
    member = member_id(pool)
    if engine is None:
        from rollart.engines.vllm_engine import VLLMEngine
        from rollart.models.tiny import ensure_model

        engine = VLLMEngine(ensure_model(config.model), config.generation)
    try:
        if not await start_engine(engine, stop):
            log.info("stop requested while the engine started: leaving before joining gen-%s", pool)
            return
        await run_member(config, stop, lambda rt: generation_member(generation_stage(rt, engine, pool, member)),
                         client_id=member)
    finally:
        engine.shutdown()


async def start_engine(engine, stop: StopRequest) -> bool:
    """Start (load, warm up) the engine; False if a stop came first (the warm-up is then skipped)."""
    try:
        return await stop.unless_requested(engine.start()) is not None
    except StartupInterrupted:
        return False


def generation_stage(rt: Runtime, engine, pool: str, member: str) -> GenerationStage:
    """The stage of one member: beside it the weight follower (a pool that follows the training
    versions), or the eval pool's pins."""
    config = rt.config
    pins = PinnedWeights(rt, engine, pool=pool, member=member) \
        if config.eval is not None and pool == config.eval.pool else None
    follower = WeightFollower(rt, engine, pool=pool, member=member) \
        if config.generation.follow_versions and pins is None else None
    return GenerationStage(rt, engine, pool, member, follower, pins)


def generation_member(stage: GenerationStage) -> Member:
    """The request loop (and the direct path's server), held in the pool registry while it runs."""
    loops: list[Service] = [generation_loop(stage.runtime, stage)]
    if stage.runtime.config.generation.transport == "direct":
        loops.append(stage.direct_server())
    return Member(loops=loops, background=[stage.follower] if stage.follower else [],
                  holding=[stage.membership()], cleanup=[stage.pins.close] if stage.pins else [])
