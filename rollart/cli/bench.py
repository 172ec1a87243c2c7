"""``rollart bench NAME --out FILE.json``: the ablations, each printing its figure beside its baseline."""

from __future__ import annotations

import asyncio
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from rollart.cli.options import BrokerOption
from rollart.config import ConfigError, load_config

console = Console() if Console().is_terminal else Console(width=200)  # tables whole in logs and CI

ConfigOption = Annotated[Optional[Path], typer.Option("--config", "-c", help="Job config YAML (endpoints, model).")]
OutOption = Annotated[Optional[Path], typer.Option(help="Write the result JSON here.")]

bench_app = typer.Typer(help="Benchmarks that print their figures.", no_args_is_help=True)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def print_result(result: dict[str, Any], columns: list[str], headline: str) -> None:
    table = Table(*columns, title=result["benchmark"])
    for row in result["rows"]:
        table.add_row(*(_fmt(row.get(c, "")) for c in columns))
    console.print(table)
    key = "efficiency" if "efficiency" in result else "speedup"
    if key not in result:  # a partial run (one side of a comparison): its rows only
        return
    console.print(f"{headline}: [bold]{result[key]:.2f}{'x' if key == 'speedup' else ''}[/bold]")


def run_benchmark(config_path: Path | None, out: Path | None, measure: Callable[..., Any], columns: list[str],
                  headline: str, **kwargs: Any) -> dict[str, Any]:
    from rollart.bench.session import write_result

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    work = Path(tempfile.mkdtemp(prefix="rollart-bench-"))
    try:
        result = asyncio.run(measure(config, work, **kwargs))
    except BaseException:
        Console(stderr=True).print(f"the benchmark failed; its runs' files are kept in {work}")
        raise
    if result.get("keep_work_dir"):  # e.g. a run that did not learn: its record is the evidence
        console.print(f"kept for inspection ({result['keep_work_dir']}): {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print_result(result, columns, headline)
    write_result(result, out)
    if out:
        console.print(f"result: {out}")
    return result


def _weight_sync_overlap(config: Path | None, out: Path | None, versions: int, hidden: int, layers: int) -> None:
    """Exposed weight-sync time per step: background pull through Mooncake vs a blocking push."""
    from rollart.bench.weight_sync import bench_weight_sync

    result = run_benchmark(config, out, bench_weight_sync, ["mode", "pull_s", "load_s", "exposed_s", "versions"],
                           "blocking exposed over background exposed", versions=versions, hidden=hidden,
                           layers=layers)
    console.print(f"share of the sync hidden behind generation: {result['hidden_share']:.0%} "
                  f"({result['bytes_per_version'] / 2**20:.0f} MiB per version)")


@bench_app.command("traj-vs-batch")
def traj_vs_batch_cmd(config: ConfigOption = None, out: OutOption = None,
                      mu: Annotated[float, typer.Option(help="Mean env step latency, seconds.")] = 0.2,
                      repeats: int = 3, trajectories: int = 128, turns: int = 16,
                      broker: BrokerOption = None) -> None:
    """Trajectory-level rollout vs batched (lock-step) env interaction, Gaussian step latency. The
    defaults are the paper's regime scaled down (env steps several times a turn's generation);
    ``--trajectories 64 --turns 8 --mu 0.05`` is an engine-bound one."""
    from rollart.bench.rollout_modes import bench_traj_vs_batch

    run_benchmark(config, out, bench_traj_vs_batch,
                  ["sigma_over_mu", "batch_s", "trajectory_s", "speedup", "env_only_speedup", "of_env_only",
                   "batch_cpu_ms_per_turn",
                   "trajectory_cpu_ms_per_turn", "trajectory_cpu_busy"],
                  "trajectory-level over batched at the largest sigma/mu", mu_s=mu, repeats=repeats,
                  groups=max(1, trajectories // 8), group_size=8, turns=turns)


@bench_app.command("redundancy")
def redundancy_cmd(config: ConfigOption = None, out: OutOption = None, redundancy: int = 2, repeats: int = 2,
                   failure_rate: Annotated[float, typer.Option(help="Per env step.")] = 0.01,
                   straggler_rate: Annotated[float, typer.Option(help="Per env step.")] = 0.02,
                   straggler_s: float = 1.5, broker: BrokerOption = None) -> None:
    """Rollout time per step with and without redundant rollouts, under env failures and stragglers."""
    from rollart.bench.redundancy import bench_redundancy

    run_benchmark(config, out, bench_redundancy,
                  ["redundancy", "rollouts_per_group", "per_step_s", "groups_released", "groups_incomplete"],
                  "redundant rollout over none (time per step)", redundancy=redundancy, repeats=repeats,
                  failure_rate=failure_rate, straggler_rate=straggler_rate, straggler_s=straggler_s)


@bench_app.command("trainer-step")
def trainer_step_cmd(run: Annotated[Optional[Path], typer.Option(
                         help="A finished run's --out directory (its trainer's record keeps each step's batch "
                              "shape): its last steps replayed after it. Without: the job (-c, default "
                              "configs/demo.yaml) is run, and its steps replayed between its steps.")] = None,
                     config: ConfigOption = None, out: OutOption = None,
                     steps: Annotated[Optional[int], typer.Option(
                         min=1, help="With --run: its last N steps (20). Without: the run's training steps "
                                     "(80).")] = None,
                     torch_threads: Annotated[Optional[int], typer.Option(
                         min=1, help="With --run; default: the run's own.")] = None,
                     first: Annotated[int, typer.Option(min=1, help="Without --run: the first step replayed.")]
                     = 20,
                     every: Annotated[int, typer.Option(min=1, help="Without --run: replay every N-th step.")] = 4,
                     replays: Annotated[int, typer.Option(min=1, help="Without --run: timed replays of each.")]
                     = 2) -> None:
    """A run's training steps timed alone on the same cores, beside their time inside the run."""
    columns = ["mode", "step_s_mean", "step_s_p50", "cpu_s_mean", "queue_s_mean"]
    headline = "trainer step in the run over alone"
    try:
        if run is not None:
            from rollart.bench.trainer_step import bench_trainer_step

            run_benchmark(config, out, bench_trainer_step, columns, headline, run=run, steps=steps or 20,
                          torch_threads=torch_threads)
        else:
            from rollart.bench.trainer_step_interleaved import bench_trainer_step_interleaved

            job = config or Path("configs/demo.yaml")
            run_benchmark(job, out, bench_trainer_step_interleaved, columns, headline, job_yaml=job,
                          steps=steps or 80, first=first, every=every, replays=replays)
    except ValueError as exc:
        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@bench_app.command("data-parallel")
def data_parallel_cmd(config: ConfigOption = None, out: OutOption = None,
                      world_size: Annotated[int, typer.Option(min=2, help="Ranks beside the one-rank step.")] = 2,
                      steps: int = 8, samples: int = 32, length: int = 256,
                      hidden: Annotated[int, typer.Option(help="Model width (a random Qwen2 made locally).")] = 256,
                      layers: int = 4) -> None:
    """A training step on one rank beside the same step on N data-parallel ranks (same cores, same batches)."""
    from rollart.bench.data_parallel import bench_data_parallel

    result = run_benchmark(config, out, bench_data_parallel, ["mode", "ranks", "threads_per_rank", "step_s_mean",
                                                              "step_s_p50"], "one rank's step over N ranks'",
                           world_size=world_size, steps=steps, samples=samples, length=length, hidden=hidden,
                           layers=layers)
    console.print(f"largest loss difference between the two: {result['loss_max_abs_diff']:.2e}")


ENGINE_COLUMNS = ["mode", "start_s", "latency_ms", "tokens_per_s", "cpu_ms_per_request_alone", "cpu_ms_per_token"]


@bench_app.command("engine-executor")
def engine_executor_cmd(config: ConfigOption = None, out: OutOption = None, concurrency: int = 64,
                        max_tokens: int = 8, repeats: int = 3) -> None:
    """vLLM's uni executor beside its mp one (the CPU default): start, one request's latency, tokens/s."""
    from rollart.bench.engine_executor import bench_engine_executor

    result = run_benchmark(config, out, bench_engine_executor, ENGINE_COLUMNS, "one request's latency, mp over uni",
                           concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
    console.print(f"start, mp over uni: {result['start_ratio']:.2f}x; tokens/s at {concurrency} in flight, "
                  f"uni over mp: {result['tokens_ratio']:.2f}x")


@bench_app.command("engine-start")
def engine_start_cmd(config: ConfigOption = None, out: OutOption = None, repeats: int = 3) -> None:
    """Seconds from a process's launch to its engine's first answer, its engine core and CPU worker forked
    from a fork server (generation.engine_core_start: forkserver) or spawned (vLLM's own way); fresh
    processes, alternated."""
    from rollart.bench.engine_start import bench_engine_start

    columns = ["mode", "repeat", "ready_s", "engine_core_forked", "workers_forked"]
    result = run_benchmark(config, out, bench_engine_start, columns, "ready, spawn over forkserver", repeats=repeats)
    console.print("median seconds to the first answer: " +
                  ", ".join(f"{m} {s:.1f}" for m, s in result["ready_s_median"].items()))


@bench_app.command("engine-wait")
def engine_wait_cmd(config: ConfigOption = None, out: OutOption = None, concurrency: int = 64,
                    max_tokens: int = 8, repeats: int = 3) -> None:
    """How the engine's queue readers wait between steps (notify, sleep, spin): latency, tokens/s and
    the CPU each costs."""
    from rollart.bench.engine_executor import bench_engine_wait

    result = run_benchmark(config, out, bench_engine_wait, ENGINE_COLUMNS, "CPU per token, sleep over notify",
                           concurrency=concurrency, max_tokens=max_tokens, repeats=repeats)
    console.print(f"notify over sleep: tokens/s {result['tokens_ratio_notify_over_sleep']:.2f}x, "
                  f"one request's latency {result['latency_ratio_notify_over_sleep']:.2f}x")


def _choice(option: str, value: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    """One of ``choices``, or all of them for "both"."""
    if value == "both":
        return choices
    if value not in choices:
        raise typer.BadParameter(f"{option} must be {', '.join(choices)} or both, not {value!r}")
    return (value,)


@bench_app.command("pipeline-efficiency")
def pipeline_cmd(config: ConfigOption = None, out: OutOption = None, trajectories: int = 64, turns: int = 8,
                 max_tokens: int = 8, repeats: int = 7,
                 broker: Annotated[Optional[str], typer.Option(
                     help="kafka | tansu | both: on a throw-away local stack of that broker (both: one after "
                          "the other). Default: the configured stack, else a local one.")] = None,
                 guarantees: Annotated[bool, typer.Option(
                     "--guarantees", help="at_least_once then exactly_once, side by side (Apache Kafka)")] = False,
                 transport: Annotated[str, typer.Option(
                     help="bus | direct | both: the turn transports measured (generation.transport)")] = "both",
                 layout: Annotated[str, typer.Option(
                     help="one-process | env-process | colocated | both (all three): the env stage in this "
                          "process beside generation, as its own process (as deployed apart), or co-located "
                          "(env.colocate_pool: each turn a function call; direct only)")] = "both",
                 ) -> None:
    """Tokens/s through the whole pipeline vs the raw vLLM engine; per-turn overhead p50/p99, per
    turn transport (the bus, or direct to the generation member) and env layout."""
    from rollart.bench.brokers import per_broker
    from rollart.bench.pipeline import LAYOUTS, TRANSPORTS, bench_pipeline, bench_pipeline_guarantees

    transports, layouts = _choice("--transport", transport, TRANSPORTS), _choice("--layout", layout, LAYOUTS)
    bench = functools.partial(bench_pipeline_guarantees if guarantees else bench_pipeline, transports=transports,
                              layouts=layouts)

    async def measure(config, work, **kwargs):
        if broker is None:
            return await bench(config, work, **kwargs)
        return await per_broker(broker, lambda kind: bench(config, work / kind, **kwargs))

    result = run_benchmark(config, out, measure, ["mode", "tokens_per_s", "seconds", "tokens", "p50_ms", "p99_ms"],
                           f"{'kafka: ' if broker == 'both' else ''}pipeline over raw engine (tokens/s, "
                           "median of back-to-back pairs)", trajectories=trajectories, turns=turns,
                           max_tokens=max_tokens, repeats=repeats)
    console.print("pairs: " + ", ".join(f"{r:.2f}" for r in result["efficiency_pairs"])
                  + f"; each mode's median run over the other's: {result['efficiency_of_medians']:.2f}")
    for kind, figures in (result.get("brokers") or {}).items():
        if kind != result["broker"]:  # the first broker's figures are the ones printed above
            print_result(figures, ["mode", "tokens_per_s", "seconds", "tokens", "p50_ms", "p99_ms"],
                         f"{kind}: pipeline over raw engine (tokens/s)")
    for guarantee, figures in (result.get("guarantees") or {}).items():
        print_result(figures, ["mode", "tokens_per_s", "trajectories_per_s", "seconds", "p50_ms", "p99_ms"],
                     f"{guarantee}: pipeline over raw engine")


@bench_app.command("scale")
def scale_cmd(config: ConfigOption = None, out: OutOption = None, trajectories: int = 1000, turns: int = 4,
              step_s: Annotated[float, typer.Option(help="Env step latency (keeps trajectories open).")] = 2.0,
              broker: BrokerOption = None) -> None:
    """One env consumer process holding N concurrent trajectories: memory and CPU per trajectory."""
    from rollart.bench.scale import bench_scale

    run_benchmark(config, out, bench_scale, ["measure", "value"], "share of the target held concurrently",
                  trajectories=trajectories, turns=turns, step_s=step_s)


@bench_app.command("elastic")
def elastic_cmd(config: ConfigOption = None, out: OutOption = None,
                phases: Annotated[str, typer.Option(help="Members per phase: ENVxGEN (generation per pool).")]
                = "1x1,2x2,1x1",
                phase_s: Annotated[float, typer.Option("--phase", help="Seconds per phase.")] = 150.0,
                settle_s: Annotated[float, typer.Option("--settle", help="Seconds of each phase not counted "
                                                                          "(engines load, groups rebalance).")] = 45.0,
                broker: BrokerOption = None) -> None:
    """One training job scaled through phases of rollout members: trajectories trained per minute per phase."""
    from rollart.bench.elastic import bench_elastic

    run_benchmark(config, out, bench_elastic, ["phase", "env", "generation", "trained", "trajectories_per_min",
                                               "per_member_per_min", "window_s"],
                  "widest phase over the first (trajectories trained per minute)", job_path=config,
                  phases=phases, phase_s=phase_s, settle_s=settle_s)


@bench_app.command("weight-sync")
def weight_sync_cmd(config: ConfigOption = None, out: OutOption = None, versions: int = 6,
                    hidden: Annotated[int, typer.Option(help="Model width (a random Qwen2 made locally).")] = 768,
                    layers: int = 12, broker: BrokerOption = None,
                    compare: Annotated[str, typer.Option(
                        help="delta: full vs delta sync, bytes and seconds per version (no engine); overlap: "
                             "background pull vs blocking push with a vLLM engine under load.")] = "delta",
                    dtype: Annotated[str, typer.Option(help="delta: the published dtype.")] = "bfloat16",
                    lr: Annotated[float, typer.Option(help="delta: the simulated optimiser step.")] = 1e-6,
                    transport: Annotated[str, typer.Option(
                        help="delta: auto (Mooncake when the stack has one) | mooncake | fs.")] = "auto",
                    codec: Annotated[str, typer.Option(help="delta: weights.delta_codec.")] = "sparse") -> None:
    """Weight sync: full vs delta (bytes moved, seconds, weights changed), or background vs blocking."""
    if compare == "overlap":
        return _weight_sync_overlap(config, out, versions, hidden, layers)
    from rollart.bench.delta_sync import bench_delta_sync
    from rollart.weights.delta import DELTA_CODECS
    from rollart.weights.publish import WEIGHT_DTYPES

    if (compare != "delta" or transport not in ("auto", "mooncake", "fs") or dtype not in WEIGHT_DTYPES
            or codec not in DELTA_CODECS):
        Console(stderr=True).print(f"[red]--compare is delta or overlap, --transport auto, mooncake or fs, "
                                   f"--dtype one of {', '.join(WEIGHT_DTYPES)}, --codec one of "
                                   f"{', '.join(DELTA_CODECS)}[/red]")
        raise typer.Exit(2)

    result = run_benchmark(config, out, bench_delta_sync,
                           ["mode", "version", "bytes", "written_bytes", "seconds", "publish_s", "pull_s",
                            "changed_fraction"], "full seconds over delta seconds per version",
                           versions=versions, hidden=hidden, layers=layers, dtype=dtype, lr=lr, transport=transport,
                           codec=codec)
    for mode, figures in result["summary"].items():
        console.print(f"{mode:>5}: {figures['seconds']:.3f} s, {figures['bytes'] / 2**20:.2f} MiB pulled, "
                      f"{figures['written_bytes'] / 2**20:.2f} MiB written per version (median)")
    console.print(f"delta pulls {result['bytes_ratio']:.1f}x fewer bytes; {result['changed_fraction']:.1%} of the "
                  f"weights changed per step ({result['version_bytes'] / 2**20:.0f} MiB per version, "
                  f"{result['dtype']}, {result['codec']} deltas, through {result['transport']})")


@bench_app.command("serverless-reward")
def serverless_reward_cmd(config: ConfigOption = None, out: OutOption = None, bursts: int = 6, burst: int = 64,
                          gap_s: float = 2.0, service_s: float = 0.05, slots: int = 4,
                          cold_start_s: float = 0.25, broker: BrokerOption = None) -> None:
    """Rewards on a dedicated worker vs the HTTP function bridge under bursty completions."""
    from rollart.bench.serverless_reward import bench_serverless_reward

    run_benchmark(config, out, bench_serverless_reward,
                  ["mode", "capacity", "burst_makespan_s", "reward_latency_p50_s", "reward_latency_p99_s",
                   "utilisation", "cold_starts", "scored"],
                  "dedicated over serverless (burst makespan)", bursts=bursts, burst=burst, gap_s=gap_s,
                  service_s=service_s, slots=slots, cold_start_s=cold_start_s)


@bench_app.command("time-to-quality")
def time_to_quality_cmd(config: Annotated[Path, typer.Option("--config", "-c", help="The job (its tags, "
                                                              "model, batch, alpha).")] = Path("configs/demo.yaml"),
                        out: OutOption = None,
                        steps: Annotated[int, typer.Option(min=1, help="Training steps of each run.")] = 150,
                        target: Annotated[float, typer.Option(min=0.0, max=1.0, help="Success rate.")] = 0.9,
                        window: Annotated[int, typer.Option(min=1, help="Steps the success is averaged over.")]
                        = 5,
                        order: Annotated[str, typer.Option(help="Which runs, in order: in-process,pipeline "
                                                                "(either alone: its figures only).")]
                        = "in-process,pipeline",
                        repeats: Annotated[int, typer.Option(min=1, help="Pairs of runs (the order alternates); "
                                                                         "the headline is their median ratio.")]
                        = 1) -> None:
    """Time to a success rate: the pipeline (rollart run) against an in-process generate-then-train loop."""
    from rollart.bench.time_to_quality import bench_time_to_quality

    try:
        result = run_benchmark(config, out, bench_time_to_quality,
                               ["mode", "repeat", "seconds_to_target", "steps_to_target", "seconds_per_step",
                                "first_step_s", "success_last_steps", "train_s_mean", "wait_s_mean"],
                               f"pipeline time over in-process time to {target:.0%} success", job_yaml=config,
                               steps=steps, target=target, window=window,
                               order=tuple(m.strip() for m in order.split(",") if m.strip()), repeats=repeats)
    except ValueError as exc:  # --order names an unknown run (checked before anything starts)
        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if "measured_on" in result:
        console.print(f"measured on: {result['measured_on']}")
    if "seconds_per_step_ratio" in result:  # what the ratio is made of (time ~ first step + steps x s/step)
        steps_part = f"steps to target {result['steps_ratio']:.2f}x, " if "steps_ratio" in result else ""
        console.print(f"pipeline over in-process, medians: {steps_part}seconds per step "
                      f"{result['seconds_per_step_ratio']:.2f}x, first step {result['first_step_later_s']:+.1f} s")


@bench_app.command("off-policy")
def off_policy_cmd(config: Annotated[Path, typer.Option("--config", "-c", help="The job (its tags, model, batch, "
                                                         "lr).")] = Path("configs/demo.yaml"),
                   out: OutOption = None,
                   steps: Annotated[int, typer.Option(min=25, help="Training steps of each run.")] = 120,
                   repeats: Annotated[int, typer.Option(min=1, help="Runs of each objective.")] = 3,
                   lag: Annotated[int, typer.Option(min=0, help="Versions the engine is behind the trainer.")] = 1,
                   objectives: Annotated[str, typer.Option(help="Comma-separated: previous, current, behaviour, "
                                                                "previous-no-dual; "
                                                                "the first is the headline's.")]
                   = "previous,current") -> None:
    """Stale batches without the pipeline: the in-process loop with its engine LAG versions behind, per
    objective: does it reach 90% success, and keep it?"""
    from rollart.bench.off_policy import bench_off_policy

    try:
        result = run_benchmark(config, out, bench_off_policy,
                               ["objective", "repeat", "steps_to_target", "success_last_steps", "held", "entropy_max",
                                "clip_fraction_mean", "grad_norm_max", "approx_kl_old_max"], "",
                               steps=steps, repeats=repeats, lag=lag,
                               objectives=tuple(o.strip() for o in objectives.split(",") if o.strip()))
    except ValueError as exc:  # an unknown objective, too few steps (checked before anything starts)
        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    for name, figures in result["summary"].items():
        console.print(f"{name}: held {figures['held']}/{figures['runs']} (lost after reaching it "
                      f"{figures['lost']}, never reached {figures['never']}); median steps to target "
                      f"{figures['steps_to_target_median']}; mean success over the last 20 steps "
                      f"{figures['success_last_steps_mean']:.0%}")
    console.print(f"runs that reached {result['target']:.0%} and held it, {next(iter(result['summary']))}: "
                  f"[bold]{result['held_share']:.0%}[/bold]")


@bench_app.command("stage-cpu")
def stage_cpu_cmd(config: Annotated[Path, typer.Option("--config", "-c", help="The job.")] = Path("configs/demo.yaml"),
                  out: OutOption = None, steps: Annotated[int, typer.Option(min=3, help="Training steps of each run.")]
                  = 30, skip: Annotated[int, typer.Option(min=1, help="First steps not counted (engine load, "
                                                                       "warm-up).")] = 5,
                  in_process: Annotated[bool, typer.Option(help="Also the in-process loop, for the ratio.")] = True) -> None:
    """CPU per stage of a run (cores, core-seconds per trained step, CPU ms per trajectory and per turn),
    beside the in-process loop's for the same steps."""
    from rollart.bench.stage_cpu import bench_stage_cpu

    try:
        result = run_benchmark(config, out, bench_stage_cpu,
                               ["mode", "stage", "processes", "cores", "core_s_per_step", "cpu_ms_per_trajectory",
                                "cpu_ms_per_turn", "share"], "pipeline CPU per step over in-process CPU per step",
                               job_yaml=config, steps=steps, skip=skip, in_process=in_process)
    except ValueError as exc:  # too few steps for the window
        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    for mode, figures in result["per_step"].items():
        phases = figures.get("phases_core_s_per_step")
        console.print(f"{mode}: {figures['seconds_per_step']:.2f} s per step, {figures['core_s_per_step']:.2f} "
                      f"core-s per step (vLLM engine {figures['engine_core_s_per_step']:.2f}"
                      + (f"; rollout {phases['rollout']:.2f}, train {phases['train']:.2f}" if phases else "")
                      + f"), train step {figures['train_s_mean']:.2f} s, {figures['turns_per_step']:.0f} turns per step")


@bench_app.command("scheduling")
def scheduling_cmd(config: Annotated[Path, typer.Option("--config", "-c", help="The job.")] = Path("configs/demo.yaml"),
                   out: OutOption = None, steps: Annotated[int, typer.Option(min=10, help="Training steps.")] = 110,
                   block: Annotated[int, typer.Option(min=2, help="Steps under one setting before the next.")] = 6,
                   settings: Annotated[str, typer.Option(help="Settings taking turns, the first the baseline: "
                                                         "runner, nice, batch, nice5+batch, nice15+batch, nice+batch, idle, slice20.")] = "runner,nice15+batch",
                   switch: Annotated[str, typer.Option(help="What the settings apply to: rollout (every stage but the "
                                                       "trainer), stack (the run's broker, Redis, Mooncake) or "
                                                       "trainer; the rest keeps the job's plan.")] = "rollout") -> None:
    """Seconds per step under each scheduling of the rollout stages (or of the local stack's services, or
    of the trainer), switched every few steps inside one run."""
    from rollart.bench.scheduling import bench_scheduling

    try:
        run_benchmark(config, out, bench_scheduling, ["setting", "nice", "policy", "slice_ms", "blocks", "s_per_step", "vs_runner",
                                                      "block_means"],
                      f"{settings.split(',')[0]} over {settings.split(',')[-1]} seconds per step",
                      job_yaml=config, steps=steps, block=block, settings=tuple(s.strip() for s in settings.split(",")),
                      switched=switch)
    except (ValueError, PermissionError) as exc:
        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@bench_app.command("goodput")
def goodput_cmd(config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Job config YAML "
                                                               "(default: the chaos job).")] = None,
                out: OutOption = None, steps: Annotated[int, typer.Option(min=2)] = 20,
                rates: Annotated[str, typer.Option(help="Per-step env failure rates.")] = "0.01,0.05,0.1",
                broker: BrokerOption = None) -> None:
    """Trained per minute as env steps fail at each rate, beside the fault-free run (goodput ratio)."""
    from rollart.bench.goodput import bench_goodput

    run_benchmark(config, out, bench_goodput,
                  ["env_failure_rate", "steps", "trained_per_min", "goodput_ratio", "replacements", "aborted",
                   "lost", "trained_twice", "longest_stall_s", "audit_holds"],
                  "goodput ratio at the highest failure rate", job_yaml=config, steps=steps,
                  rates=tuple(float(r) for r in rates.split(",") if r.strip()))


@bench_app.command("eval-cost")
def eval_cost_cmd(config: Annotated[Path, typer.Option("--config", "-c", help="The job, without eval: (an "
                                                       "eval pool and held-out copies of its tags are added).")]
                  = Path("configs/demo.yaml"), out: OutOption = None, steps: int = 20, warmup: int = 2,
                  every: Annotated[int, typer.Option(min=1, help="eval.every_versions of the eval run.")] = 5,
                  tasks: Annotated[int, typer.Option(min=1, help="Eval tasks per tag.")] = 16) -> None:
    """Training throughput with held-out evaluation running beside it, against the same job without."""
    from rollart.bench.eval_cost import bench_eval_cost

    run_benchmark(config, out, bench_eval_cost,
                  ["mode", "trajectories_per_s", "step_s", "wait_s_mean", "train_s_mean", "eval_versions",
                   "eval_s_mean", "eval_success_last", "throughput_vs_no_eval"],
                  "training throughput with eval over without", job_yaml=config, steps=steps, warmup=warmup,
                  every=every, tasks=tasks)


@bench_app.command("async")
def async_cmd(config: ConfigOption = None, out: OutOption = None, steps: int = 10, warmup: int = 2,
              modes: Annotated[str, typer.Option(help="Comma-separated subset of sync,one-off,alpha=1,alpha=2.")]
              = "sync,one-off,alpha=1,alpha=2", broker: BrokerOption = None) -> None:
    """Training throughput: sync (alpha 0), one-off, alpha 1 and 2; generation and trainer on separate CPUs."""
    from rollart.bench.async_modes import bench_async

    run_benchmark(config, out, bench_async,
                  ["mode", "trajectories_per_s", "tokens_per_s", "step_s", "wait_s_mean", "train_s_mean",
                   "staleness_max", "speedup_vs_sync"],
                  "best asynchronous mode over sync (trajectories/s)", job_yaml=config, steps=steps,
                  warmup=warmup, modes=tuple(m.strip() for m in modes.split(",") if m.strip()))
