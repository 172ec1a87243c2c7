"""``rollart bench data-parallel``: one training step on one rank beside the same step on N ranks.

The same batches (shaped like a run's: ``samples`` trajectories of about ``length`` tokens, a
quarter of them generated) go through the torch backend twice from the same initial weights: one
rank with every core's threads, then ``world_size`` ranks (rollart/training/distributed.py, gloo)
with the cores shared out. Reported: step seconds each way, their ratio, and the largest loss
difference between the two (the ranks take the one-rank step; only float order differs). On one
machine the ranks share its cores and memory bandwidth, so this prices the all-reduce and the
batch broadcast more than it shows a speed-up: data parallelism pays across machines or GPUs.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from rollart.config import RollartConfig


def _batches(config: RollartConfig, vocab: int, *, steps: int, samples: int, length: int) -> list:
    from rollart.bench.trainer_step import shaped_batch
    from rollart.training.torch_backend import collate

    rng = random.Random(0)
    out = []
    for _ in range(steps + 1):  # the first warms up (allocations), untimed
        lengths = [max(8, int(rng.gauss(length, length / 4))) for _ in range(samples)]
        generated = [n // 4 for n in lengths]
        out.append(collate(shaped_batch(lengths, generated, config.feeder.group_size, vocab, rng), pad_id=0,
                           norm=config.trainer.advantage_norm))
    return out


def _timed(backend, batches: list) -> tuple[list[float], list[float]]:
    seconds, losses = [], []
    for i, batch in enumerate(batches):
        started = time.perf_counter()
        metrics = backend.train_step(batch)
        if i:
            seconds.append(time.perf_counter() - started)
        losses.append(metrics["loss"])
    return seconds, losses


def _row(mode: str, ranks: int, threads: int, seconds: list[float]) -> dict[str, Any]:
    return {"mode": mode, "ranks": ranks, "threads_per_rank": threads, "step_s_mean": statistics.mean(seconds),
            "step_s_p50": statistics.median(seconds)}


def _measure(config: RollartConfig, work: Path, world_size: int, steps: int, samples: int, length: int,
             hidden: int, layers: int) -> dict[str, Any]:
    import torch

    from rollart.models.tiny import init_tiny_model
    from rollart.stages.trainer import build_backend
    from rollart.training import distributed
    from rollart.training.ranks import Rendezvous

    cores = len(os.sched_getaffinity(0))
    model = init_tiny_model(work / "model", hidden=hidden, layers=layers, heads=max(2, hidden // 64))
    one = config.with_updates("bench data-parallel", model={"path": str(model), "init_tiny": False},
                              trainer={"world_size": 1, "torch_threads": cores, "backend": "torch"})
    threads = max(1, cores // world_size)
    many = one.with_updates("bench data-parallel", trainer={"world_size": world_size, "torch_threads": threads})
    threads_before = torch.get_num_threads()
    try:
        single = build_backend(one)
        batches = _batches(one, int(single.model.config.vocab_size), steps=steps, samples=samples, length=length)
        one_s, one_loss = _timed(single, batches)
        del single
        rdzv = Rendezvous.local(world_size)
        children = distributed.start_local_ranks(many, rdzv, work / "ranks")
        parallel = distributed.data_parallel(many, rdzv, children, build_backend)
        try:
            many_s, many_loss = _timed(parallel, batches)
        finally:
            parallel.close()
    finally:
        torch.set_num_threads(threads_before)
    ratio = statistics.mean(one_s) / statistics.mean(many_s)
    return {"benchmark": "data-parallel", "speedup": ratio,
            "loss_max_abs_diff": max(abs(a - b) for a, b in zip(one_loss, many_loss)),
            "setup": {"cores": cores, "steps": steps, "samples": samples, "length": length, "hidden": hidden,
                      "layers": layers, "parameters": sum(p.numel() for p in parallel.backend.model.parameters())},
            "rows": [_row("one rank", 1, cores, one_s), _row(f"{world_size} ranks", world_size, threads, many_s)]}


async def bench_data_parallel(config: RollartConfig, work: Path, *, world_size: int = 2, steps: int = 8,
                              samples: int = 32, length: int = 256, hidden: int = 256,
                              layers: int = 4) -> dict[str, Any]:
    import asyncio

    if world_size < 2:
        raise ValueError("--world-size: compare one rank with 2 or more")
    return await asyncio.to_thread(_measure, config, work, world_size, steps, samples, length, hidden, layers)
