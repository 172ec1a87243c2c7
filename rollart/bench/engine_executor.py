"""``rollart bench engine-executor``: vLLM's two executors on this machine, side by side.

The same model and engine settings, started once with each executor (``generation.executor``):

* ``uni``: the model runs in the engine core's process;
* ``mp``: vLLM's own CPU default (what "auto" gets there), a worker process below the engine core,
  every engine step passed to it through a shared-memory queue.

Reported for each: seconds to start the engine (construct and warm up), the median latency of one
request alone (``max_tokens`` tokens: the per-turn cost at low load) and tokens/s with
``concurrency`` requests in flight. Ratios are mp over uni (above 1: uni is better).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from rollart.config import RollartConfig
from rollart.messages import GenerationRequest, Int32Array, SamplingParams


def _request(i: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(traj_id=f"t{i}-{time.monotonic_ns()}", turn=0, group_id="g", tag="bench", pool="bench",
                             prompt_ids=Int32Array([1, 2, 3, 4, 5 + i % 50]), reply_partition=0,
                             sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens))


async def _measure(engine, *, concurrency: int, max_tokens: int, repeats: int) -> dict[str, float]:
    latencies = []
    for i in range(repeats * 10):
        started = time.perf_counter()
        await engine.generate(_request(i, max_tokens))
        latencies.append(time.perf_counter() - started)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(_request(i, max_tokens)) for i in range(concurrency)))
        rates.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - started))
    return {"latency_ms": statistics.median(latencies) * 1000, "tokens_per_s": statistics.median(rates)}


async def bench_engine_executor(config: RollartConfig, work_dir: Path, *, concurrency: int = 64, max_tokens: int = 8,
                                repeats: int = 3) -> dict[str, Any]:
    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.models.tiny import ensure_model

    model = ensure_model(config.model)
    await asyncio.to_thread(__import__, "vllm.v1.engine.async_llm")  # neither start pays the import
    rows = []
    for executor in ("uni", "mp"):
        engine = VLLMEngine(model, config.generation.model_copy(update={"executor": executor,
                                                                        "max_concurrency": concurrency}))
        started = time.perf_counter()
        await engine.start()
        try:
            start_s = time.perf_counter() - started
            figures = await _measure(engine, concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
        finally:
            engine.shutdown()
        rows.append({"mode": executor, "start_s": start_s, **figures})
    uni, mp = rows
    return {"benchmark": "engine-executor", "speedup": mp["latency_ms"] / uni["latency_ms"],
            "start_ratio": mp["start_s"] / uni["start_s"], "tokens_ratio": uni["tokens_per_s"] / mp["tokens_per_s"],
            "setup": {"concurrency": concurrency, "max_tokens": max_tokens, "repeats": repeats}, "rows": rows}
