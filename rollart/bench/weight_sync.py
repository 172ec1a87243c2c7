"""``rollart bench weight-sync``: exposed weight-sync time per step, background pull vs blocking push.

One engine generates continuously (a stream of requests, as during rollout) while the trainer side
publishes each new version's buckets to the Mooncake store. Two ways to take a version:

* background (rollart): pull the buckets into local staging while generation goes on, then pause,
  load from staging, resume: only the load is exposed;
* blocking: pause generation, transfer the buckets, load, resume: transfer and load are exposed.

Hidden share = 1 - background exposed / blocking exposed (paper: 67-78% hidden). A model larger than
the tiny one (``--hidden``/``--layers``) makes the transfer a realistic share of the sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

from rollart.bench.session import BENCH_POOL, BenchSession, bench_session
from rollart.config import RollartConfig
from rollart.messages import GenerationRequest, Int32Array, SamplingParams
from rollart.weights.publish import WeightPublisher, pull_version
from rollart.weights.transport import MooncakeTransport


async def _keep_generating(session: BenchSession, stop: asyncio.Event, concurrency: int = 16) -> int:
    """Rollout-like load: ``concurrency`` requests in flight until ``stop``; returns requests served."""
    params = SamplingParams(temperature=1.0, max_tokens=16)
    served = 0

    async def worker(w: int) -> None:
        nonlocal served
        n = 0
        while not stop.is_set():
            request = GenerationRequest(traj_id=f"load-{w}-{n}", turn=0, group_id="load", tag="load", pool=BENCH_POOL,
                                        prompt_ids=Int32Array(range(1, 65)), reply_partition=0, sampling=params)
            await session.engine.generate(request)
            served, n = served + 1, n + 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return served


async def _sync_once(session: BenchSession, transport, manifest, version: int, staging: Path, mode: str) -> dict:
    if mode == "background":
        started = time.perf_counter()
        directory = await asyncio.to_thread(pull_version, transport, manifest, version, staging)
        pull_s = time.perf_counter() - started
        load_s = await session.engine.load_weights(directory, version)
        return {"pull_s": pull_s, "load_s": load_s, "exposed_s": load_s}
    started = time.perf_counter()
    async with session.engine.paused():  # generation stops for the transfer and the load
        directory = await asyncio.to_thread(pull_version, transport, manifest, version, staging)
        pull_s = time.perf_counter() - started
        await session.engine.load_weights_paused(directory, version)
    exposed = time.perf_counter() - started
    return {"pull_s": pull_s, "load_s": exposed - pull_s, "exposed_s": exposed}


async def bench_weight_sync(config: RollartConfig, work_dir: Path, *, versions: int = 6, hidden: int = 768,
                            layers: int = 12) -> dict[str, Any]:
    from rollart.models.tiny import init_tiny_model

    model_path = init_tiny_model(work_dir / "model", hidden=hidden, layers=layers, heads=max(2, hidden // 64))
    async with bench_session(config, work_dir, model_path=model_path, mooncake=None, max_concurrency=64) as session:
        return await _measure(session, work_dir, model_path, versions)


async def _measure(session: BenchSession, work_dir: Path, model_path: Path, versions: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    if not (session.endpoints.mooncake_master and session.endpoints.mooncake_metadata):
        raise RuntimeError("weight-sync needs a Mooncake store (pip install rollart[weights]; the local stack starts one)")
    state = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).state_dict()
    transport = await asyncio.to_thread(MooncakeTransport, session.endpoints.mooncake_master,
                                        session.endpoints.mooncake_metadata, local_buffer_bytes=128 << 20)
    publisher = WeightPublisher(transport=transport, job=f"bench-ws-{int(time.time())}", bucket_bytes=32 << 20)
    stop = asyncio.Event()
    load = asyncio.create_task(_keep_generating(session, stop))
    runs: dict[str, list[dict]] = {"background": [], "blocking": []}
    try:
        for version in range(1, 2 * versions + 1):
            mode = "background" if version % 2 else "blocking"  # interleaved: the same load on both
            manifest, _ = await asyncio.to_thread(publisher.publish, version, state)
            await asyncio.sleep(0.5)  # the load is running again after the previous sync
            runs[mode].append(await _sync_once(session, transport, manifest, version, work_dir / "staging", mode))
            await asyncio.to_thread(publisher.collect, version + 1)  # one version in the store at a time
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await load
        transport.close()
    return _result(runs, manifest.total_bytes)


def _result(runs: dict[str, list[dict]], nbytes: int) -> dict[str, Any]:
    rows = []
    for mode, samples in runs.items():
        rows.append({"mode": mode, "pull_s": statistics.median(s["pull_s"] for s in samples),
                     "load_s": statistics.median(s["load_s"] for s in samples),
                     "exposed_s": statistics.median(s["exposed_s"] for s in samples), "versions": len(samples),
                     "runs_exposed_s": [s["exposed_s"] for s in samples]})
    background, blocking = rows[0], rows[1]
    hidden = 1 - background["exposed_s"] / blocking["exposed_s"]
    return {"benchmark": "weight-sync", "speedup": blocking["exposed_s"] / background["exposed_s"],
            "hidden_share": hidden, "paper_hidden_share": "0.67-0.78", "bytes_per_version": nbytes, "rows": rows}
