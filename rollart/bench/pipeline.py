"""``rollart bench pipeline-efficiency``: what the bus costs on top of the engine.

The same multi-turn trajectories (``CountdownEnv``, no env latency, ``turns`` LLM turns each), the
same engine, the same number in flight, run two ways:

* raw: coroutines call the vLLM engine directly and step the env in-process (the best any rollout
  loop on this engine could do);
* pipeline, per turn transport: rollart's env stage and generation member exchange every turn over the
  bus (GenerationRequest on ``gen.requests.<pool>``, GenerationResult on ``env.actions``) or directly
  (``generation.transport: direct``, the member's ZeroMQ socket);
* and per layout: the env stage in this process (one event loop for env, generation and the engine's
  client, so every turn's Python waits behind every other's; the direct path still over its socket),
  as its own process (``rollart consume env``, as deployed apart; its overhead histogram read from its
  /metrics), or co-located (``env.colocate_pool``, as ``rollart consume envgen`` runs it: in this
  process, each turn a function call; the direct transport only).

Efficiency = pipeline tokens/s over raw tokens/s (1.0 = no tax), run by run: each repeat runs the raw
engine and the pipeline back to back (alternating which goes first) and the figure is the median of
those pairs' ratios, so each ratio compares two runs of the same few seconds of the host (a run here
lasts ~1.5 s, and the host's speed moves by more than the tax between minutes: the ratio of each
mode's median run, ``efficiency_of_medians``, read 0.88-1.04 over three 3-repeat runs of one hour).
The per-turn overhead is the time from
the env's request to its result's arrival at the env member, minus the engine's own time for the request
(``rollart_env_generation_overhead_seconds``); beside it the env member's own wait from that arrival to
the trajectory resuming (``rollart_env_turn_resume_wait_seconds``: its event loop busy with the other
trajectories' turns). p50/p99 from those histograms over the measured runs, as Grafana would show them.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from prometheus_client import REGISTRY

from rollart.bench.env_process import env_process
from rollart.bench.envs import CountdownEnv
from rollart.chaos.scrape import bucket_quantile
from rollart.bench.session import BENCH_POOL, BenchSession, bench_session
from rollart.config import RollartConfig
from rollart.messages import GenerationRequest, Int32Array, SamplingParams


async def _raw_trajectory(session: BenchSession, traj_id: str, seed: int, turns: int, max_tokens: int) -> int:
    env, chat = CountdownEnv(turns=turns), session.chat
    tokens = chat.initial(env.system_prompt, await env.reset(seed))
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=chat.stop_token_ids)
    generated = 0
    for turn in range(turns):
        request = GenerationRequest(traj_id=traj_id, turn=turn, group_id=traj_id, tag="work", pool=BENCH_POOL,
                                    prompt_ids=Int32Array(tokens), reply_partition=0, sampling=params)
        result = await session.engine.generate(request)
        generated += len(result.token_ids)
        step = await env.step(chat.decode_action(result.token_ids))
        if step.done:
            break
        tokens = tokens + list(result.token_ids) + chat.continuation(step.observation, result.token_ids)
    return generated


async def _raw(session: BenchSession, prefix: str, n: int, turns: int, max_tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    counts = await asyncio.gather(*(_raw_trajectory(session, f"{prefix}{i}", i, turns, max_tokens) for i in range(n)))
    return time.perf_counter() - started, sum(counts)


async def _pipeline(harness, prefix: str, n: int, group_size: int) -> tuple[float, int]:
    ids = [f"{prefix}g{g}" for g in range(n // group_size)]
    started = time.perf_counter()
    for g, group_id in enumerate(ids):
        await harness.submit(group_id, "work", group_size=group_size, seed=g)
    await harness.wait_groups({group_id: group_size for group_id in ids}, timeout=900)
    elapsed = time.perf_counter() - started
    trajectories = [harness.completed[t] for group_id in ids for t in harness.ended(group_id)["completed"]]
    if len(trajectories) != n:
        raise RuntimeError(f"{n - len(trajectories)} trajectories did not complete")
    return elapsed, sum(int(sum(t.loss_mask)) for t in trajectories)


OVERHEAD = "rollart_env_generation_overhead_seconds"
RESUME_WAIT = "rollart_env_turn_resume_wait_seconds"
TRANSPORTS = ("bus", "direct")
# Where the env stage runs: in this process beside generation (one event loop for env, generation and
# the engine's client), as its own process, as deployed apart (``rollart consume env``), or co-located
# with the generation member (``rollart consume envgen``: turns are function calls).
LAYOUTS = ("one-process", "env-process", "colocated")

Buckets = dict[float, float]


def local_buckets(name: str, job: str) -> Buckets:
    """A histogram's cumulative buckets in this process's registry, summed over the job's series."""
    buckets: Buckets = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name == f"{name}_bucket" and sample.labels.get("job") == job:
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


def quantiles_between(before: Buckets, after: Buckets, *qs: float) -> list[float]:
    """Prometheus' ``histogram_quantile`` over what was observed between two reads of the buckets."""
    increase = [(le, count - before.get(le, 0.0)) for le, count in after.items()]
    return [bucket_quantile(increase, q) for q in qs]


@contextlib.asynccontextmanager
async def pipeline_under(session: BenchSession, cfg: RollartConfig, layout: str,
                         work_dir: Path) -> AsyncIterator[tuple[Any, Callable[[str], Buckets]]]:
    """The pipeline of ``cfg`` with its env stage where ``layout`` says, and a read of the env stage's
    histograms (by name)."""
    async with session.harness(cfg, env=layout != "env-process") as harness:
        if layout != "env-process":
            yield harness, lambda name: local_buckets(name, cfg.job)
            return
        async with env_process(cfg, work_dir, name=cfg.job) as env:
            def read(name: str) -> Buckets:
                sample = env.histogram(name)
                return sample.buckets if sample is not None else {}
            yield harness, read


async def bench_pipeline(config: RollartConfig, work_dir: Path, *, trajectories: int, turns: int, max_tokens: int,
                         repeats: int, transports: tuple[str, ...] = TRANSPORTS,
                         layouts: tuple[str, ...] = LAYOUTS[:1]) -> dict[str, Any]:
    """For each env layout and turn transport (``generation.transport``) in turn, on one engine: its
    pipeline and the raw engine, interleaved (see :func:`measure_pipeline`). One pipeline's loops at a
    time: idle consumer loops of another job would tax the one measured. The top-level figures are
    the last pipeline's (direct in the last layout, unless told otherwise)."""
    rows, figures = [], []
    async with bench_session(config, work_dir) as session:
        await _raw(session, "warmup-raw-", 8, turns, max_tokens)
        for layout in layouts:
            for transport in (t for t in transports if t == "direct" or layout != "colocated"):
                figure, measured = await measure_pipeline(session, work_dir, transport, layout,
                                                          trajectories=trajectories, turns=turns,
                                                          max_tokens=max_tokens, repeats=repeats)
                figures.append(figure)
                rows += measured
    headline = figures[-1]
    return {"benchmark": "pipeline-efficiency", **headline,
            "turn_overhead_p50_s": headline["overhead_p50_s"], "turn_overhead_p99_s": headline["overhead_p99_s"],
            "transports": {f["transport"]: f for f in figures if f["layout"] == layouts[0]},
            "pipelines": {f["pipeline"]: f for f in figures}, "processing_guarantee": config.bus.processing_guarantee,
            "setup": {"trajectories_in_flight": trajectories, "turns": turns, "max_tokens": max_tokens,
                      "repeats": repeats}, "rows": rows}


async def measure_pipeline(session: BenchSession, work_dir: Path, transport: str, layout: str, *, trajectories: int,
                           turns: int, max_tokens: int, repeats: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One pipeline (``transport``, ``layout``) beside the raw engine, ``repeats`` runs of each in
    alternating order: its figures (efficiency against the raw runs beside it; per-turn overhead
    p50/p99, the warm-up's turns left out) and its table rows."""
    name = transport if layout == "one-process" else f"{transport}, {layout}"
    tag = {"env": "rollart.bench.envs:CountdownEnv", "env_kwargs": {"turns": turns}, "max_turns": turns,
           "reward": {"type": "env"}}
    env = {"max_groups": trajectories, "sampling": {"max_tokens": max_tokens},
           "colocate_pool": BENCH_POOL if layout == "colocated" else None}  # whatever the job's layout
    cfg = session.config(f"bench-pipeline-{transport}-{layout}", tags={"work": tag}, env=env,
                         generation={"transport": transport})
    runs: dict[str, list[tuple[float, int]]] = {"raw": [], "pipeline": []}
    async with pipeline_under(session, cfg, layout, work_dir) as (harness, histogram):
        await harness.ready()
        await _pipeline(harness, "warmup-", 8, 8)
        before = {metric: histogram(metric) for metric in (OVERHEAD, RESUME_WAIT)}
        for rep in range(repeats):
            for mode in (("raw", "pipeline") if rep % 2 == 0 else ("pipeline", "raw")):
                if mode == "raw":
                    runs[mode].append(await _raw(session, f"raw{rep}-", trajectories, turns, max_tokens))
                else:
                    runs[mode].append(await _pipeline(harness, f"p{rep}-", trajectories, 8))
        after = {metric: histogram(metric) for metric in (OVERHEAD, RESUME_WAIT)}
    p50, p99 = quantiles_between(before[OVERHEAD], after[OVERHEAD], 0.5, 0.99)
    wait50, wait99 = quantiles_between(before[RESUME_WAIT], after[RESUME_WAIT], 0.5, 0.99)
    raw, pipeline = _row(f"raw (beside {name})", runs["raw"], trajectories), \
        _row(f"pipeline, {name}", runs["pipeline"], trajectories)
    pairs = paired_ratios(runs["raw"], runs["pipeline"])
    figure = {"pipeline": name, "transport": transport, "layout": layout,
              "efficiency": statistics.median(pairs), "efficiency_pairs": pairs,
              "efficiency_of_medians": pipeline["tokens_per_s"] / raw["tokens_per_s"], "overhead_p50_s": p50,
              "overhead_p99_s": p99, "resume_wait_p50_s": wait50, "resume_wait_p99_s": wait99,
              "turns_measured": after[OVERHEAD].get(float("inf"), 0.0) - before[OVERHEAD].get(float("inf"), 0.0)}
    return figure, [raw, pipeline, {"mode": f"{name}: overhead per turn", "p50_ms": p50 * 1000, "p99_ms": p99 * 1000},
                    {"mode": f"{name}: env member's wait to resume", "p50_ms": wait50 * 1000, "p99_ms": wait99 * 1000}]


def paired_ratios(raw: list[tuple[float, int]], pipeline: list[tuple[float, int]]) -> list[float]:
    """Each repeat's pipeline tokens/s over its raw run's (runs as (seconds, tokens), in repeat order)."""
    return [(p_tokens / p_s) / (r_tokens / r_s) for (r_s, r_tokens), (p_s, p_tokens) in zip(raw, pipeline, strict=True)]


def _row(mode: str, results: list[tuple[float, int]], trajectories: int) -> dict[str, Any]:
    """A mode's median run."""
    rates = sorted(tokens / seconds for seconds, tokens in results)
    seconds = sorted(s for s, _ in results)[len(results) // 2]
    return {"mode": mode, "tokens_per_s": rates[len(rates) // 2],
            "seconds": seconds, "trajectories_per_s": trajectories / seconds, "tokens": results[0][1],
            "runs_tokens_per_s": rates}


GUARANTEES = ("at_least_once", "exactly_once")


async def bench_pipeline_guarantees(config: RollartConfig, work_dir: Path, **kwargs: Any) -> dict[str, Any]:
    """The pipeline under each processing guarantee, one after the other on the same broker: what
    exactly-once (transactions on the env and reward hops, read_committed everywhere) costs."""
    results = {}
    for guarantee in GUARANTEES:
        variant = config.model_copy(update={"bus": config.bus.model_copy(update={"processing_guarantee": guarantee})})
        results[guarantee] = await bench_pipeline(variant, work_dir / guarantee, **kwargs)
    return {**results["at_least_once"], "guarantees": results}
