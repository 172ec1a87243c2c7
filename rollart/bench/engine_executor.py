"""``rollart bench engine-executor``: vLLM's two executors on this machine, side by side.

The same model and engine settings, started once with each executor (``generation.executor``):

* ``uni``: the model runs in the engine core's process;
* ``mp``: vLLM's own CPU default (what "auto" gets there), a worker process below the engine core,
  every engine step passed to it through a shared-memory queue.

Reported for each: seconds to start the engine (construct and warm up), the median latency of one
request alone (``max_tokens`` tokens: the per-turn cost at low load) and tokens/s with
``concurrency`` requests in flight, each with the CPU it cost. Ratios are mp over uni (above 1: uni
is better).

``rollart bench engine-wait`` runs the same measurements for the ways the engine's internal queue
readers wait between steps (``generation.engine_wait``: notify, sleep, spin): on a machine the
engine shares, the CPU a token costs is what the rest of the loop loses.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from rollart.config import RollartConfig
from rollart.proctree import tree_cpu_s
from rollart.messages import GenerationRequest, Int32Array, SamplingParams


def _request(i: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(traj_id=f"t{i}-{time.monotonic_ns()}", turn=0, group_id="g", tag="bench", pool="bench",
                             prompt_ids=Int32Array([1, 2, 3, 4, 5 + i % 50]), reply_partition=0,
                             sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens))


def _cpu_s() -> float:
    """CPU seconds of this process and every process below it (the engine core, its worker)."""
    return tree_cpu_s(os.getpid()) or 0.0


async def _measure(engine, *, concurrency: int, max_tokens: int, repeats: int) -> dict[str, float]:
    latencies = []
    cpu_before = _cpu_s()
    for i in range(repeats * 10):
        started = time.perf_counter()
        await engine.generate(_request(i, max_tokens))
        latencies.append(time.perf_counter() - started)
    cpu_alone = (_cpu_s() - cpu_before) / len(latencies)
    rates, tokens, cpu_before = [], 0, _cpu_s()
    for _ in range(repeats):
        started = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(_request(i, max_tokens)) for i in range(concurrency)))
        generated = sum(len(r.token_ids) for r in results)
        tokens += generated
        rates.append(generated / (time.perf_counter() - started))
    return {"latency_ms": statistics.median(latencies) * 1000, "tokens_per_s": statistics.median(rates),
            "cpu_ms_per_request_alone": cpu_alone * 1000, "cpu_ms_per_token": (_cpu_s() - cpu_before) / tokens * 1000}


async def measure_variants(config: RollartConfig, variants: dict[str, dict[str, Any]], *, concurrency: int,
                           max_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """One row per variant (``generation`` settings over ``config``'s): the engine started with them,
    its start time, one request's latency and CPU alone, tokens/s and CPU per token at ``concurrency``
    in flight. CPU counts this process (the engine's client) and the engine's own processes."""
    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.models.tiny import ensure_model

    model = ensure_model(config.model)
    await asyncio.to_thread(__import__, "vllm.v1.engine.async_llm")  # no variant's start pays the import
    rows = []
    for name, settings in variants.items():
        engine = VLLMEngine(model, config.generation.model_copy(update={**settings, "max_concurrency": concurrency}))
        started = time.perf_counter()
        await engine.start()
        try:
            start_s = time.perf_counter() - started
            figures = await _measure(engine, concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
        finally:
            engine.shutdown()
        rows.append({"mode": name, "start_s": start_s, **figures})
    return rows


async def bench_engine_executor(config: RollartConfig, work_dir: Path, *, concurrency: int = 64, max_tokens: int = 8,
                                repeats: int = 3) -> dict[str, Any]:
    rows = await measure_variants(config, {"uni": {"executor": "uni"}, "mp": {"executor": "mp"}},
                                  concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
    uni, mp = rows
    return {"benchmark": "engine-executor", "speedup": mp["latency_ms"] / uni["latency_ms"],
            "start_ratio": mp["start_s"] / uni["start_s"], "tokens_ratio": uni["tokens_per_s"] / mp["tokens_per_s"],
            "setup": {"concurrency": concurrency, "max_tokens": max_tokens, "repeats": repeats}, "rows": rows}


async def bench_engine_wait(config: RollartConfig, work_dir: Path, *, concurrency: int = 64, max_tokens: int = 8,
                            repeats: int = 3) -> dict[str, Any]:
    """How the engine's internal queue readers wait between steps (``generation.engine_wait``), on
    vLLM's CPU default executor (mp: the engine core hands every step to a worker process)."""
    rows = await measure_variants(config, {wait: {"engine_wait": wait, "executor": "mp"}
                                           for wait in ("notify", "sleep", "spin")},
                                  concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
    by = {row["mode"]: row for row in rows}
    cpu_ratio = by["sleep"]["cpu_ms_per_token"] / by["notify"]["cpu_ms_per_token"]
    return {"benchmark": "engine-wait", "speedup": cpu_ratio, "cpu_per_token_sleep_over_notify": cpu_ratio,
            "tokens_ratio_notify_over_sleep": by["notify"]["tokens_per_s"] / by["sleep"]["tokens_per_s"],
            "latency_ratio_notify_over_sleep": by["notify"]["latency_ms"] / by["sleep"]["latency_ms"],
            "setup": {"concurrency": concurrency, "max_tokens": max_tokens, "repeats": repeats}, "rows": rows}
