"""``rollart bench trainer-step --run OUT``: a run's training steps timed
alone, on the same cores, beside what they took inside the run.

The trainer's record keeps each step's batch shape (every sample's length and generated tokens, and
which prefixes the samples share) and its ``train_s``. This replays the same shapes (token ids drawn
at random in the recorded prefix tree: compute depends on the shapes and the sharing, not on the ids)
through the same backend and config, one step after the other with nothing else running, and reports
in-run ÷ alone: what sharing the machine with the rest of the loop costs the trainer (the "Loop
throughput" goal: within 1.3x); then the same steps in the other precision and with the prefix tree
the other way. Both sides time the same work in the training thread (the batch's collation and the
step), and where the record has them (since the thirty-ninth session) the training thread's seconds on
a core and waiting for one (:mod:`rollart.training.thread_clock`): a step slower in the run either
waited for its core or ran slower on it. The replay runs after the run, on another minute of a shared
host; without ``--run`` the bench runs the job and replays its steps between them
(:mod:`rollart.bench.trainer_step_interleaved`), so both sides share the minute.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from rollart.config import RollartConfig
from rollart.messages import Float32Array, Int32Array, ScoredTrajectory, UInt8Array
from rollart.messages.samples import sample_trajectory
from rollart.training.checkpoint import CheckpointStore
from rollart.training.thread_clock import ThreadTimes, timed


def shaped_batch(lengths: list[int], generated: list[int], group_size: int, vocab: int,
                 rng: random.Random, shared_prefix: list[list[int]] | None = None,
                 rewards: list[float] | None = None) -> list[ScoredTrajectory]:
    """Scored trajectories of exactly these lengths, the last ``generated`` tokens of each trained, the
    recorded prefixes shared (:func:`shared_ids`; none: every row its own random tokens) and the recorded
    rewards (a group of equal rewards is not computed; none: random rewards, nearly every group trained)."""
    ids = shared_ids(lengths, shared_prefix or [[i, 0] for i in range(len(lengths))], vocab, rng)
    samples = []
    for i, (n, g) in enumerate(zip(lengths, generated)):
        g = max(1, min(g, n - 1))
        t = sample_trajectory(f"b-g{i // group_size}-t{i}", n_prompt=n - g, n_gen=g, version=0)
        t = replace(t, group_id=f"b-g{i // group_size}", token_ids=Int32Array(ids[i]),
                    loss_mask=UInt8Array([0] * (n - g) + [1] * g),
                    logprobs=Float32Array([0.0] * (n - g) + [-1.0] * g))
        reward = rewards[i] if rewards is not None else float(rng.random() < 0.5)
        samples.append(ScoredTrajectory(trajectory=t, reward=reward, scorer="bench"))
    return samples


def shared_ids(lengths: list[int], shared_prefix: list[list[int]], vocab: int, rng: random.Random) -> list[list[int]]:
    """Random token ids in the recorded tree: following the record's ``shared_prefix`` (the samples in
    lexicographic order, each with the tokens it shares with the one before), each row repeats its
    predecessor's first tokens and then goes its own way, so the batch has the run's distinct prefixes."""
    ids: list[list[int]] = [[] for _ in lengths]
    before: list[int] = []
    for i, shared in shared_prefix:
        fresh = [rng.randrange(vocab) for _ in range(lengths[i] - shared)]
        if fresh and shared < len(before) and fresh[0] == before[shared]:
            fresh[0] = (fresh[0] + 1) % vocab  # where the recorded rows part, these part too
        ids[i] = before[:shared] + fresh
        before = ids[i]
    return ids


def recorded_steps(run: Path, last: int) -> list[dict]:
    """The last ``last`` steps of a run (its ``--out`` directory, or its checkpoints directory)."""
    store = CheckpointStore(run / "checkpoints" if (run / "checkpoints").is_dir() else run)
    rows = [r for r in store.read_record() if "event" not in r and r.get("lengths")]
    if not rows:
        raise ValueError(f"{store.record_path}: no step carries its batch shape (no such run, an empty one, "
                         "or a record written before the shapes were kept)")
    return rows[-last:]


async def bench_trainer_step(config: RollartConfig, work_dir: Path, *, run: Path, steps: int = 20,
                             torch_threads: int | None = None) -> dict[str, Any]:
    import asyncio

    return await asyncio.to_thread(_measure, config, run, steps, torch_threads)


def _measure(config: RollartConfig, run: Path, steps: int, torch_threads: int | None) -> dict[str, Any]:
    import torch

    from rollart.stages.trainer import build_backend

    rows = recorded_steps(run, steps)
    config = replay_config(config, rows[-1], torch_threads)
    threads_before = torch.get_num_threads()
    try:
        return _replay(build_backend(config), config, rows)
    finally:
        torch.set_num_threads(threads_before)  # the backend set the run's count for this process


def replay_config(config: RollartConfig, row: dict, torch_threads: int | None = None) -> RollartConfig:
    """``config`` as the run's trainer ran ``row``: its torch threads (unless ``torch_threads``) and
    its precision (records since each was kept)."""
    trainer: dict[str, Any] = {}
    if torch_threads or row.get("torch_threads"):
        trainer["torch_threads"] = torch_threads or row["torch_threads"]
    if row.get("mixed_precision"):
        trainer["mixed_precision"] = row["mixed_precision"]
    return config.model_copy(update={"trainer": config.trainer.model_copy(update=trainer)}) if trainer else config


def _replay(backend, config: RollartConfig, rows: list[dict]) -> dict[str, Any]:
    """The steps alone as the run trained them, then (the same backend, the same batches) in the other
    ``trainer.mixed_precision`` and with the other ``trainer.prefix_tree``: what bf16 would save this
    run's trainer on these cores, and what the prefix tree saves it (or would)."""
    import torch

    from rollart.training.torch_backend import autocast_dtype, cpu_has_bf16

    in_run = [recorded_times(row) for row in rows]
    precision, tree = config.trainer.mixed_precision, backend.prefix_tree
    other = "bf16" if precision == "no" else "no"
    alone = timed_steps(backend, config, rows)
    backend.mixed_precision = autocast_dtype(other, backend.device)
    alone_other = timed_steps(backend, config, rows)
    backend.mixed_precision = autocast_dtype(precision, backend.device)
    backend.prefix_tree = not tree  # (a Megatron backend has none: both rows then run its own forward)
    alone_flipped = timed_steps(backend, config, rows)
    ratio = mean_of(in_run, "wall_s") / mean_of(alone, "wall_s")
    bf16, fp32 = (alone_other, alone) if other == "bf16" else (alone, alone_other)
    with_tree, padded = (alone, alone_flipped) if tree else (alone_flipped, alone)
    recorded = [r for r in rows if "distinct_tokens" in r]
    cpu_in_run = mean_of(in_run, "cpu_s")
    return {"benchmark": "trainer-step", "speedup": ratio, "in_run_over_alone": ratio,
            # on a core only: > 1 is the step running slower in the run (caches, memory), not waiting
            "cpu_in_run_over_alone": None if cpu_in_run is None else cpu_in_run / mean_of(alone, "cpu_s"),
            "queue_s_in_run": mean_of(in_run, "queue_s"),
            "bf16_over_fp32": mean_of(bf16, "wall_s") / mean_of(fp32, "wall_s"),
            "tree_over_padded": mean_of(with_tree, "wall_s") / mean_of(padded, "wall_s"),
            "setup": {"steps": len(rows), "torch_threads": torch.get_num_threads(), "mixed_precision": precision,
                      "prefix_tree": tree, "cpu_bf16": cpu_has_bf16(),
                      "samples_per_step": statistics.mean(len(r["lengths"]) for r in rows),
                      "tokens_per_sample": statistics.mean(statistics.mean(r["lengths"]) for r in rows),
                      # the batches' distinct prefixes, of their tokens (steps recorded before it: none)
                      "distinct_token_share": (sum(r["distinct_tokens"] for r in recorded)
                                               / sum(sum(r["lengths"]) for r in recorded)) if recorded else None},
            "rows": [timing_row("in the run", in_run), timing_row("alone", alone),
                     timing_row(f"alone, mixed_precision {other}", alone_other),
                     timing_row(f"alone, prefix_tree {'off' if tree else 'on'}", alone_flipped)]}


def recorded_times(row: dict) -> ThreadTimes:
    """A recorded step's times in the trainer's thread (the clocks are None in records from before them)."""
    return ThreadTimes(row["train_s"], row.get("train_cpu_s"), row.get("train_queue_s"))


def mean_of(times: list[ThreadTimes], field: str) -> Any:
    values = [getattr(t, field) for t in times]
    return None if None in values else statistics.mean(values)


def timing_row(mode: str, times: list[ThreadTimes]) -> dict[str, Any]:
    return {"mode": mode, "step_s_mean": mean_of(times, "wall_s"),
            "step_s_p50": statistics.median(t.wall_s for t in times),
            "cpu_s_mean": mean_of(times, "cpu_s"), "queue_s_mean": mean_of(times, "queue_s")}


def replayed_step(backend, config: RollartConfig, row: dict, rng: random.Random) -> partial[dict]:
    """``row``'s batch shape (random ids in its prefix tree, its rewards) through the trainer's own
    step, collated and trained, as a call."""
    from rollart.stages.trainer import collated_step

    samples = shaped_batch(row["lengths"], row["generated"], config.feeder.group_size,
                           int(backend.model.config.vocab_size), rng, row.get("shared_prefix"), row.get("rewards"))
    return partial(collated_step, backend, samples, config, version=0, pad_id=0)


def timed_steps(backend, config: RollartConfig, rows: list[dict]) -> list[ThreadTimes]:
    """Each row's batch shape through the trainer's own step, one step each, after one untimed step
    (first-step allocations are not the trainer's steady cost); the times of each, as the trainer
    takes them."""
    rng = random.Random(0)
    replayed_step(backend, config, rows[0], rng)()
    return [timed(replayed_step(backend, config, row, rng))[1] for row in rows]
