"""What the in-process benchmarks share: one stack, one engine, a harness per run, result files."""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from rollart.bench.harness import RolloutHarness
from rollart.config import RollartConfig, build_config
from rollart.endpoints import Endpoints

BENCH_POOL = "bench"


@dataclass
class BenchSession:
    base: RollartConfig
    endpoints: Endpoints
    engine: Any
    chat: Any
    model_path: Path
    # The stack's services this session started (the broker's JVM...), by name: their CPU counts in a
    # benchmark's accounting; a configured stack's are not this machine's to read.
    services: dict[str, int] = field(default_factory=dict)

    def config(self, job: str, **sections: Any) -> RollartConfig:
        """A job config for one run on this session's stack and engine."""
        data: dict[str, Any] = {
            "job": f"{job}-{uuid.uuid4().hex[:6]}", "pools": [BENCH_POOL],
            "kafka": {"bootstrap": self.endpoints.kafka_bootstrap, "broker": self.endpoints.broker},
            "redis": {"url": self.endpoints.redis_url},
            "model": {"path": str(self.model_path), "init_tiny": False},
            "generation": {"max_concurrency": 512, "max_model_len": 2048, "fetch_max_wait_ms": 5,
                           "transport": self.base.generation.transport},  # the job's turn path
            "feeder": {"alpha": None},
            "env": {"max_groups": 256, "generation_timeout_s": 600, "step_timeout_s": 600,
                    "sampling": {"temperature": 1.0, "max_tokens": 2},
                    # the job's layout: its env stage co-located with generation (the bench pool's)
                    "colocate_pool": BENCH_POOL if self.base.env.colocate_pool else None},
            # The bus's own long-poll (500 ms): at 5 ms the harness's idle loops (tasks, observer, rewards)
            # took ~15% of the in-process pipeline bench's event loop in fetch requests (py-spy).
            "bus": {"max_in_flight": 4096, "commit_interval_s": 0.2,
                    "processing_guarantee": self.base.bus.processing_guarantee},
        }
        for key, value in sections.items():
            data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
        return build_config(data, f"bench {job}")

    @contextlib.asynccontextmanager
    async def harness(self, config: RollartConfig, *, env: bool = True) -> AsyncIterator[RolloutHarness]:
        from rollart.runtime import open_runtime
        from rollart.stages.runner import freeze_startup_heap
        from rollart.topics import expand_catalog
        from rollart.topics.admin import apply_topics

        await apply_topics(config, self.endpoints, expand_catalog(config))
        async with open_runtime(config, serve=False) as rt:
            harness = RolloutHarness(config, rt, self.engine, self.chat)
            await harness.start(config.pools, env=env)
            freeze_startup_heap()  # as a deployed member does before its loops
            try:
                yield harness
            finally:
                await harness.close()


@contextlib.asynccontextmanager
async def bench_session(config: RollartConfig, work_dir: Path, *, max_concurrency: int = 512,
                        model_path: Path | None = None, mooncake: bool | None = False) -> AsyncIterator[BenchSession]:
    """The configured (or a throw-away local) stack and one vLLM engine on the job's model (or
    ``model_path``); ``mooncake=None`` starts a Mooncake store with a throw-away stack."""
    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.models.tiny import ensure_model
    from rollart.bench.stage_cpu import stack_pids
    from rollart.rollout.chat import ChatFormat
    from rollart.local.endpoints import job_endpoints
    from rollart.local.stack import STACK_FILE

    model_path = Path(model_path or ensure_model(config.model))
    with job_endpoints(config, work_dir / "stack", mooncake=mooncake) as endpoints:
        engine = VLLMEngine(model_path, config.generation.model_copy(update={"max_concurrency": max_concurrency,
                                                                            "max_model_len": 2048}))
        await engine.start()
        try:
            yield BenchSession(config, endpoints, engine, ChatFormat.from_pretrained(model_path), model_path,
                               stack_pids(work_dir / "stack" / STACK_FILE))
        finally:
            engine.shutdown()


def write_result(result: dict[str, Any], out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
