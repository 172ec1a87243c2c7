"""The benchmark commands run and write the JSON the README and the issue promise.

Small settings: this checks the machinery (the figures are measured with the defaults, by hand).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.bench.async_modes import _throughput
from rollart.bench.envs import CountdownEnv, set_lockstep
from tests.conftest import REPO


def bench(tmp_path, stack, model, *args: str) -> dict:
    out = tmp_path / f"{args[0]}.json"
    env = {**os.environ, "ROLLART_KAFKA_BOOTSTRAP": stack.kafka_bootstrap, "ROLLART_REDIS_URL": stack.redis_url,
           "ROLLART_MODEL_PATH": str(model), "ROLLART_MODEL_INIT_TINY": "false"}
    result = subprocess.run([sys.executable, "-m", "rollart.cli", "bench", *args, "--out", str(out)], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == args[0] and data["rows"]
    assert isinstance(data.get("speedup", data.get("efficiency")), float)
    return data


async def test_traj_vs_batch_runs_both_schedules(endpoints, engine, chat, tiny_model):
    """In-process on the session's engine (the CLI glue is the same as the async benchmark's, tested below)."""
    from rollart.bench.rollout_modes import _measure
    from rollart.bench.session import BenchSession
    from tests.conftest import make_config

    session = BenchSession(make_config(endpoints), endpoints, engine, chat, tiny_model)
    data = await _measure(session, 0.05, (0.5, 1.0), 1, 8, 2, 1)
    assert [row["sigma_over_mu"] for row in data["rows"]] == [0.5, 1.0]
    for row in data["rows"]:
        # the ratio is the benchmark's figure, not a test's: timings on a shared machine are noise
        assert row["batch_s"] > 0 and row["trajectory_s"] > 0
        assert row["speedup"] == pytest.approx(row["batch_s"] / row["trajectory_s"], rel=0.01)
        assert row["of_env_only"] == pytest.approx(row["speedup"] / row["env_only_speedup"])
        for mode in ("batch", "trajectory"):  # what a turn cost, and where: this process and the engine's
            cpu = row["cpu"][mode]
            assert cpu["cpu_ms_per_turn"]["stages"] > 0 and cpu["cpu_ms_per_turn"]["engine"] > 0
            assert row[f"{mode}_cpu_ms_per_turn"] == cpu["cpu_ms_per_turn"]["total"] == \
                pytest.approx(cpu["cpu_ms_per_turn"]["stages"] + cpu["cpu_ms_per_turn"]["engine"])
            assert 0 < cpu["cpu_busy"] <= 1.2
            # each turn's request takes 2 steps (max_tokens 2: its prefill, then one decode), shared with others
            assert 0 < cpu["engine_steps_per_turn"] <= 2


def test_the_env_only_figure_is_one_without_variance_and_grows_with_it():
    """With generation free, lock step costs nothing when every env step takes the same time, and
    more the wider the latencies spread (the figure the paper's 1.23x-2.27x is about)."""
    from rollart.bench.rollout_modes import env_only_speedup
    from rollart.config import Latency

    def figure(sigma_over_mu: float) -> float:
        return env_only_speedup(Latency(dist="gaussian", mean_s=0.05, sigma_s=0.05 * sigma_over_mu), 64, 8, draws=50)

    assert figure(0.0) == pytest.approx(1.0)
    assert 1.0 < figure(0.1) < figure(0.5) < figure(1.0) < 2.5
    # fewer turns: a trajectory's sum averages less of its spread away
    assert env_only_speedup(Latency(dist="gaussian", mean_s=0.05, sigma_s=0.05), 64, 2, draws=50) < figure(1.0)


def test_overhead_quantiles_count_only_the_turns_between_two_reads():
    from rollart.bench.pipeline import quantiles_between

    inf = float("inf")
    warm_up = {0.01: 10.0, 0.1: 10.0, inf: 10.0}  # 10 fast turns before the measured runs
    after = {0.01: 10.0, 0.1: 30.0, inf: 30.0}  # then 20 in (10 ms, 100 ms]
    p50, p99 = quantiles_between(warm_up, after, 0.5, 0.99)
    assert p50 == pytest.approx(0.055) and p99 == pytest.approx(0.0991)  # over all 30 the p50 would be 32.5 ms


def test_pipeline_efficiency_is_the_median_of_back_to_back_pairs():
    """A slow stretch of the host slows both runs of its pair: the pairs' median sees no tax where the
    ratio of each mode's median run sees one."""
    from rollart.bench.pipeline import paired_ratios

    raw = [(1.0, 1000), (2.0, 1000), (1.0, 1000)]  # (seconds, tokens): the second pair in a slow stretch
    pipeline = [(1.0, 1000), (2.0, 1000), (1.25, 1000)]
    assert paired_ratios(raw, pipeline) == pytest.approx([1.0, 1.0, 0.8])
    with pytest.raises(ValueError):
        paired_ratios(raw, pipeline[:2])


async def test_pipeline_bench_runs_the_env_stage_as_its_own_process(tmp_path, endpoints, engine, chat, tiny_model):
    """The deployed layout: ``rollart consume env`` in its own process, the overhead read from its /metrics."""
    from rollart.bench.pipeline import measure_pipeline
    from rollart.bench.session import BenchSession
    from tests.conftest import make_config

    session = BenchSession(make_config(endpoints), endpoints, engine, chat, tiny_model)
    figure, rows = await measure_pipeline(session, tmp_path, "direct", "env-process", trajectories=8, turns=2,
                                          max_tokens=2, repeats=1)
    assert figure["pipeline"] == "direct, env-process"
    assert figure["turns_measured"] == 8 * 2  # the measured run's turns; the warm-up's are left out
    assert 0 <= figure["overhead_p50_s"] <= figure["overhead_p99_s"] < 60
    raw, pipeline, overhead, resume = rows
    assert raw["tokens"] > 0 and pipeline["tokens"] > 0 and figure["efficiency"] > 0
    assert figure["efficiency"] == pytest.approx(figure["efficiency_pairs"][0])  # one repeat, one pair
    assert overhead["p50_ms"] == pytest.approx(figure["overhead_p50_s"] * 1000)
    assert 0 <= figure["resume_wait_p50_s"] <= figure["resume_wait_p99_s"] < 60
    assert resume["p99_ms"] == pytest.approx(figure["resume_wait_p99_s"] * 1000)


def test_serverless_reward_scores_every_burst(tmp_path, stack, tiny_model):
    data = bench(tmp_path, stack, tiny_model, "serverless-reward", "--bursts", "2", "--burst", "16", "--gap-s", "0.5")
    dedicated, serverless = data["rows"]
    assert dedicated["scored"] == serverless["scored"] == 32
    assert serverless["cold_starts"] >= 1 and dedicated["cold_starts"] == 0
    assert 0 < dedicated["utilisation"] <= 1


async def test_lockstep_envs_wait_for_the_slowest():
    set_lockstep("t", 2)
    fast, slow = CountdownEnv(turns=2, lockstep="t"), CountdownEnv(turns=2, lockstep="t")
    await fast.reset(0)
    await slow.reset(1)

    async def late_step():
        await asyncio.sleep(0.2)
        return await slow.step("Left")

    loop = asyncio.get_running_loop()
    started = loop.time()
    first, _ = await asyncio.gather(fast.step("Left"), late_step())
    assert loop.time() - started >= 0.2 and not first.done
    results = await asyncio.gather(fast.step("Up"), slow.step("Up"))
    assert all(r.done and r.reward == 1.0 for r in results)


def test_async_throughput_is_measured_after_the_warmup():
    record = [{"time": 100.0 + 10 * i, "samples": 32, "tokens": 64, "staleness_max": 1, "wait_s": 1.0, "train_s": 2.0}
              for i in range(5)]
    record.insert(2, {"event": "resume"})
    result = _throughput(record, warmup=2)
    assert result["trajectories_per_s"] == pytest.approx(32 * 2 / 20)
    assert result["tokens_per_s"] == pytest.approx(64 * 2 / 20)
    with pytest.raises(RuntimeError):
        _throughput(record[:3], warmup=2)


def test_async_runs_a_training_job_pinned_and_measures_it(tmp_path, stack, tiny_model):
    data = bench(tmp_path, stack, tiny_model, "async", "--steps", "3", "--warmup", "1", "--modes", "one-off")
    (row,) = data["rows"]
    assert row["mode"] == "one-off" and row["trajectories_per_s"] > 0 and row["staleness_max"] <= 1
    assert data["speedup"] == 1.0  # the only mode is its own baseline
    if len(os.sched_getaffinity(0)) >= 2:
        assert data["pinning"]["generation"] and data["pinning"]["trainer"]
        assert not set(data["pinning"]["generation"]) & set(data["pinning"]["trainer"])


# A recorded batch's prefixes: in lexicographic order rows 2, 0, 3, 1, each sharing its first tokens
# with the row before it (row 0 six with row 2, ...): 9 + 6 + 9 + 12 = 36 distinct of 56 tokens
LENGTHS, SHARED_PREFIX = [12, 20, 9, 15], [[2, 0], [0, 6], [3, 6], [1, 8]]


def test_a_replayed_batch_shares_the_recorded_prefixes():
    import random

    from rollart.bench.trainer_step import shaped_batch
    from rollart.stages.trainer import _shared_prefixes
    from rollart.training.prefix_tree import PrefixTree
    from tests.training.test_prefix_tree import padded

    samples = shaped_batch(LENGTHS, [3, 5, 1, 4], 2, 100, random.Random(0), SHARED_PREFIX)
    rows = [s.trajectory.token_ids.tolist() for s in samples]
    assert [len(r) for r in rows] == LENGTHS
    assert rows[0][:6] == rows[2][:6] and rows[3][:6] == rows[0][:6] and rows[1][:8] == rows[3][:8]
    assert len(PrefixTree.of(*padded(rows))) == 36
    recorded = _shared_prefixes(samples)  # what the trainer's record keeps of them
    assert recorded["distinct_tokens"] == 36 and sorted(n for _, n in recorded["shared_prefix"]) == [0, 6, 6, 8]
    # the recorded rewards, so a group of equal rewards is left out of the replayed step as in the run
    from rollart.training.torch_backend import collate

    rewarded = shaped_batch(LENGTHS, [3, 5, 1, 4], 2, 100, random.Random(0), SHARED_PREFIX, [1.0, 1.0, 0.0, 1.0])
    assert collate(rewarded, pad_id=0, norm="group_mean").advantages.tolist() == [0.0, 0.0, -0.5, 0.5]
    unshared = shaped_batch(LENGTHS, [3, 5, 1, 4], 2, 100, random.Random(0))  # a record from before: random rows
    assert _shared_prefixes(unshared)["distinct_tokens"] > 50


async def test_trainer_step_replays_a_runs_batch_shapes_alone(tmp_path, tiny_model, monkeypatch):
    """The record keeps each step's shape; the bench times the same shapes alone beside the run's time,
    in the run's precision, then in the other one, then with the prefix tree off."""
    import json

    import torch

    from rollart.training.torch_backend import TorchBackend

    autocast_seen: list[bool] = []
    trees: list[int | None] = []
    forward = TorchBackend._micro_loss

    def recording(self, micro):
        autocast_seen.append(torch.is_autocast_enabled("cpu"))
        tree = self._tree(micro)
        trees.append(len(tree) if tree is not None else None)
        return forward(self, micro)

    monkeypatch.setattr(TorchBackend, "_micro_loss", recording)

    from rollart.bench.trainer_step import bench_trainer_step, shaped_batch
    from rollart.config import build_config

    rng = __import__("random").Random(0)
    batch = shaped_batch([12, 20, 9, 15], [3, 5, 1, 4], 2, 100, rng)
    assert [len(s.trajectory.token_ids) for s in batch] == [12, 20, 9, 15]
    assert [int(sum(s.trajectory.loss_mask)) for s in batch] == [3, 5, 1, 4]
    assert {s.trajectory.group_id for s in batch} == {"b-g0", "b-g1"}
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    rows = [{"step": i + 1, "train_s": 0.5, "train_cpu_s": 0.3, "train_queue_s": 0.1 * i, "lengths": LENGTHS,
             "generated": [3, 5, 1, 4], "torch_threads": 1, "shared_prefix": SHARED_PREFIX, "distinct_tokens": 36}
            for i in range(3)]
    rows.insert(1, {"event": "publish", "step": 1})
    (tmp_path / "run" / "checkpoints" / "record.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = build_config({"model": {"path": str(tiny_model)}, "feeder": {"group_size": 2},
                           "trainer": {"micro_batch": 2}})
    result = await bench_trainer_step(config, tmp_path, run=tmp_path / "run", steps=2)
    assert result["setup"]["steps"] == 2 and result["setup"]["torch_threads"] == 1
    alone = result["rows"][1]["step_s_mean"]
    assert alone > 0 and result["in_run_over_alone"] == pytest.approx(0.5 / alone)
    # the training thread's time on a core, in the run (recorded) and alone (the same thread's clock)
    alone_cpu = result["rows"][1]["cpu_s_mean"]
    assert 0 < alone_cpu <= alone * 1.05 + 0.002 and result["rows"][1]["queue_s_mean"] >= 0
    assert result["cpu_in_run_over_alone"] == pytest.approx(0.3 / alone_cpu)
    assert result["queue_s_in_run"] == pytest.approx(0.15) and result["rows"][0]["queue_s_mean"] == pytest.approx(0.15)
    assert result["setup"]["mixed_precision"] == "no" and result["rows"][2]["mode"] == "alone, mixed_precision bf16"
    assert result["bf16_over_fp32"] == pytest.approx(result["rows"][2]["step_s_mean"] / alone)
    third = len(autocast_seen) // 3
    assert autocast_seen == [False] * third + [True] * third + [False] * third, "float32, bf16, float32"
    assert None not in trees[:2 * third] and trees[2 * third:] == [None] * third, "the tree, then padded rows"
    assert result["rows"][3]["mode"] == "alone, prefix_tree off" and result["setup"]["prefix_tree"]
    assert result["tree_over_padded"] == pytest.approx(alone / result["rows"][3]["step_s_mean"])
    assert result["setup"]["distinct_token_share"] == pytest.approx(36 / 56)
    # a run recorded in bf16 replays in bf16 first, whatever the bench's own config says; a record from
    # before the thread's clock was kept has no on-core figure to compare
    rows = [{**r, "mixed_precision": "bf16", "train_cpu_s": None} if "event" not in r else r for r in rows]
    (tmp_path / "run" / "checkpoints" / "record.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    autocast_seen.clear()
    result = await bench_trainer_step(config, tmp_path, run=tmp_path / "run", steps=2)
    assert result["setup"]["mixed_precision"] == "bf16" and result["rows"][2]["mode"] == "alone, mixed_precision no"
    assert autocast_seen == [True] * third + [False] * third + [True] * third
    assert result["cpu_in_run_over_alone"] is None and result["rows"][0]["cpu_s_mean"] is None
    with pytest.raises(ValueError, match="no step carries its batch shape"):
        await bench_trainer_step(config, tmp_path, run=tmp_path / "empty")


def test_time_to_quality_finds_the_first_window_at_the_target():
    from rollart.bench.time_to_quality import time_to_target

    success = [0.0, 0.2, 0.5, 0.9, 1.0, 0.95, 1.0, 1.0]
    rows = [{"step": i + 1, "time": 100.0 + 2 * i, "success_rate": s, "train_s": 1.0, "wait_s": 0.5}
            for i, s in enumerate(success)]
    rows.insert(2, {"event": "publish", "step": 2, "time": 103.0})
    figures = time_to_target(rows, 90.0, target=0.9, window=3)
    # windows of 3: ..., (0.9, 1.0, 0.95) at step 6 is the first with a mean >= 0.9
    assert figures["steps_to_target"] == 6 and figures["seconds_to_target"] == 110.0 - 90.0
    assert figures["first_step_s"] == 10.0 and figures["seconds_per_step"] == 2.0
    never = time_to_target(rows, 90.0, target=0.99, window=3)
    assert never["seconds_to_target"] is None and never["steps_to_target"] is None
    with pytest.raises(ValueError, match="no training steps"):
        time_to_target([{"event": "publish"}], 0.0, target=0.9, window=1)


def test_time_to_quality_headline_is_the_median_of_each_repeats_pair():
    from rollart.bench.time_to_quality import pipeline_over_in_process

    def row(mode, repeat, seconds, steps, total=200.0):
        return {"mode": mode, "repeat": repeat, "seconds_to_target": seconds, "steps_to_target": steps,
                "seconds_total": total, "seconds_per_step": total / 150,
                "first_step_s": 20.0 if mode == "pipeline" else 17.0 + repeat}

    rows = [row("in-process", 1, 100.0, 80), row("pipeline", 1, 90.0, 88),
            row("pipeline", 2, 120.0, 100), row("in-process", 2, 100.0, 80),
            row("in-process", 3, 80.0, 70), row("pipeline", 3, None, None, total=300.0)]
    figures = pipeline_over_in_process(rows)
    assert figures["ratios"] == [0.9, 1.2, 1.5], "a pair where one missed the target: over whole runs"
    assert figures["speedup"] == figures["pipeline_over_in_process"] == 1.2
    assert figures["steps_ratio"] == statistics.median([88 / 80, 100 / 80])
    assert figures["seconds_per_step_ratio"] == pytest.approx(1.0), "level per step but in repeat 3"
    assert figures["first_step_later_s"] == pytest.approx(1.0), "median of 2, 1 and 0 s later"
    assert figures["measured_on"].startswith("whole runs in 1 of 3")
    assert pipeline_over_in_process(rows[:4])["measured_on"] == "time to target"


def test_off_policy_tells_a_run_that_kept_its_success_from_one_that_collapsed():
    from rollart.bench.off_policy import run_figures, summarise

    def run(success: list[float], entropy: float) -> list[dict]:
        return [{"step": i + 1, "time": float(i), "success_rate": s, "train_s": 1.0, "wait_s": 0.5,
                 "metrics": {"entropy": entropy if i == 10 else 0.5, "clip_fraction": 0.1,
                             "grad_norm": 18.0 if i == 12 else 0.3, "approx_kl_old": entropy / 5 if i == 13 else 0.0}}
                for i, s in enumerate(success)]

    held = run_figures(run([0.1] * 10 + [1.0] * 30, 0.9), target=0.9, window=5)
    assert held["steps_to_target"] == 15 and held["held"] and not held["lost"]
    collapsed = run_figures(run([0.1] * 10 + [1.0] * 10 + [0.0] * 20, 6.0), target=0.9, window=5)
    assert collapsed["steps_to_target"] == 15 and collapsed["lost"] and not collapsed["held"]
    assert collapsed["entropy_max"] == 6.0 and collapsed["success_last_steps"] == 0.0
    assert collapsed["grad_norm_max"] == 18.0 and collapsed["approx_kl_old_max"] == pytest.approx(1.2)
    never = run_figures(run([0.1] * 40, 0.9), target=0.9, window=5)
    assert never["steps_to_target"] is None and not never["held"] and not never["lost"]
    rows = [{"objective": "previous", **held}, {"objective": "current", **collapsed},
            {"objective": "current", **never}]
    summary = summarise(rows, ("previous", "current"))
    assert summary["previous"] == {"runs": 1, "reached": 1, "held": 1, "lost": 0, "never": 0,
                                   "steps_to_target_median": 15, "success_last_steps_mean": 1.0}
    assert summary["current"]["reached"] == 1 and summary["current"]["lost"] == 1 and summary["current"]["never"] == 1
    assert summary["current"]["success_last_steps_mean"] == pytest.approx(0.05)


def _assert_full_vs_delta_rows(data: dict, versions: int) -> None:
    rows = data["rows"]
    assert [(r["mode"], r["version"]) for r in rows] == [(m, v) for v in range(1, versions + 2) for m in ("full", "delta")]
    for row in rows:
        assert isinstance(row["bytes"], int) and row["seconds"] > 0 and row["bytes"] <= row["version_bytes"]
    assert rows[0]["bytes"] == rows[1]["bytes"] == data["version_bytes"], "the first version is whole in both modes"
    for full, delta in zip(rows[2::2], rows[3::2]):
        assert full["bytes"] == full["written_bytes"] == data["version_bytes"]
        # few bf16 weights change per step: the delta puller reads a small share of the version
        assert 0 < full["changed_fraction"] == delta["changed_fraction"] < 0.2
        assert 0 < delta["bytes"] < full["bytes"] / 3 and delta["deltas"] > 0 and delta["fallbacks"] == 0
    assert data["bytes_ratio"] > 3 and 0 < data["changed_fraction"] < 0.2


def test_weight_sync_full_vs_delta_rows_in_process(tmp_path):
    """The measurement on a filesystem transport: no stack needed."""
    from rollart.bench.delta_sync import _measure
    from rollart.config import build_config

    data = _measure(build_config({}), tmp_path, 2, 64, 2, "bfloat16", 1e-6, "fs", 1 << 16)
    assert data["transport"] == "fs" and isinstance(data["speedup"], float)
    _assert_full_vs_delta_rows(data, versions=2)


def test_weight_sync_cli_compares_full_and_delta_through_mooncake(tmp_path, stack, tiny_model):
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"mooncake": {"master": stack.mooncake_master,
                                                "metadata_server": stack.mooncake_metadata}}))
    data = bench(tmp_path, stack, tiny_model, "weight-sync", "--versions", "2", "--hidden", "64", "--layers", "2",
                 "--transport", "mooncake", "--config", str(job))
    assert data["transport"] == "mooncake" and data["compare"] == "delta"
    _assert_full_vs_delta_rows(data, versions=2)


def test_weight_sync_counts_changed_float32_weights_and_skips_deltas_that_do_not_pay(tmp_path):
    """Published in the master's own dtype (float32) every weight moves each step: the fraction is 1 and
    no delta is worth writing, so delta sync pulls every changed bucket whole."""
    from rollart.bench.delta_sync import _measure
    from rollart.config import build_config

    data = _measure(build_config({}), tmp_path, 1, 64, 2, "float32", 1e-3, "fs", 1 << 16)
    steps = [r for r in data["rows"] if r["version"] > 1]
    assert all(r["changed_fraction"] > 0.99 for r in steps)
    delta = next(r for r in steps if r["mode"] == "delta")
    assert delta["deltas"] == 0 and delta["bytes"] == delta["version_bytes"]


async def test_engine_executor_measures_latency_alone_and_tokens_in_flight(engine):
    """The measuring half of `rollart bench engine-executor`, on the suite's engine (the command
    starts one engine per executor: a minute of this machine, measured by hand)."""
    from rollart.bench.engine_executor import _measure

    figures = await _measure(engine, concurrency=4, max_tokens=3, repeats=1)
    assert figures["latency_ms"] > 0 and figures["tokens_per_s"] > 0
    # the engine runs in this process (uni): its CPU is counted, per request alone and per token in flight
    assert figures["cpu_ms_per_request_alone"] > 0 and figures["cpu_ms_per_token"] > 0


@pytest.mark.timeout(300)
def test_engine_start_times_a_fresh_process_per_start_method(tmp_path, stack, tiny_model, engine):
    """`rollart bench engine-start --repeats 1`: one start of each method, each a process of its own
    that answered a request; its engine core and worker forked by the fork server, or spawned (the
    core this process's child, the worker the core's), as asked, the worker bound to the same CPUs
    either way; the headline is spawn's time over forkserver's. The suite's uni engine (``engine``)
    runs in this process: its variable does not make the children's engines uni."""
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    data = bench(tmp_path, stack, tiny_model, "engine-start", "--repeats", "1")
    rows = {row["mode"]: row for row in data["rows"]}
    assert set(rows) == {"forkserver", "spawn"} and all(row["tokens"] == 1 for row in rows.values())
    assert rows["forkserver"]["engine_core_forked"] and not rows["spawn"]["engine_core_forked"]
    assert rows["forkserver"]["workers_forked"] and not rows["spawn"]["workers_forked"]
    assert rows["forkserver"]["worker_cpus"] == rows["spawn"]["worker_cpus"] != []
    assert data["speedup"] == pytest.approx(rows["spawn"]["ready_s"] / rows["forkserver"]["ready_s"])


def test_a_benchmark_keeps_its_work_dir_when_it_fails_or_asks_and_removes_it_otherwise():
    from rollart.cli.bench import run_benchmark

    dirs: dict[str, Path] = {}

    def measuring(name: str, outcome):
        async def measure(config, work: Path) -> dict:
            (work / "record.jsonl").write_text("{}\n")  # what a run leaves
            dirs[name] = work
            if isinstance(outcome, Exception):
                raise outcome
            return {"benchmark": name, "rows": [], **outcome}
        return measure

    with pytest.raises(RuntimeError, match="engine died"):
        run_benchmark(None, None, measuring("failed", RuntimeError("engine died")), ["mode"], "-")
    run_benchmark(None, None, measuring("missed", {"keep_work_dir": "did not reach 90%: pipeline"}), ["mode"], "-")
    run_benchmark(None, None, measuring("fine", {}), ["mode"], "-")
    assert (dirs["failed"] / "record.jsonl").exists() and (dirs["missed"] / "record.jsonl").exists()
    assert not dirs["fine"].exists()
    for name in ("failed", "missed"):
        shutil.rmtree(dirs[name])


def test_bench_jobs_take_the_configs_turn_path_and_layout(tmp_path):
    """A benchmark measures the job's own layout: a config that co-locates env and generation gets bench
    jobs that do (on the bench pool); pipeline-efficiency's layouts override it either way."""
    from rollart.bench.session import BENCH_POOL, BenchSession
    from rollart.config import build_config
    from rollart.endpoints import Endpoints

    endpoints = Endpoints("127.0.0.1:9", "redis://127.0.0.1:9", "config")
    apart = build_config({"generation": {"transport": "direct"}})
    together = apart.with_updates(env={"colocate_pool": "default"})
    for base, expected in ((apart, None), (together, BENCH_POOL)):
        session = BenchSession(base, endpoints, None, None, tmp_path)
        job = session.config("j", env={"max_groups": 4})
        assert job.env.colocate_pool == expected and job.generation.transport == "direct"
        assert session.config("j", env={"colocate_pool": None}).env.colocate_pool is None


def test_each_time_to_quality_pair_runs_on_seeds_of_its_own(tmp_path):
    """The in-process loop is deterministic for given seeds: pairs on one seed would set the pipeline's
    spread against one draw of it. Repeat k moves the tasks', the sampling's and the trainer's seeds by
    k - 1, in the file the pipeline's stages load and in the in-process loop's config alike."""
    from rollart.bench.time_to_quality import SEEDED, repeat_job
    from rollart.config import load_config

    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text("job: ttq\nfeeder: {seed: 5, group_size: 4}\ntrainer: {lr: 0.001}\n")
    config = load_config(job_yaml)
    assert repeat_job(job_yaml, config, 1, tmp_path / "work") == (job_yaml, config)
    path, moved = repeat_job(job_yaml, config, 3, tmp_path / "work")
    from_file = load_config(path)
    for section in SEEDED:
        assert getattr(moved, section).seed == getattr(from_file, section).seed == getattr(config, section).seed + 2
    assert from_file.feeder.group_size == moved.feeder.group_size == 4 and from_file.trainer.lr == 0.001
    assert from_file.job == moved.job == "ttq"
