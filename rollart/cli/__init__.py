"""The ``rollart`` command."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from rollart.config import ConfigError, RollartConfig, load_config
from rollart.endpoints import NoEndpointError
from rollart.names import REWARDS_RESULTS
from rollart.stages.registry import STAGES as _STAGES

STAGE_NAMES = tuple(_STAGES)

app = typer.Typer(help="rollart: disaggregated multi-task agentic RL on Kafka consumer groups.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
local_app = typer.Typer(help="The embedded local stack (Apache Kafka or Tansu, Redis, Mooncake).", no_args_is_help=True)
topics_app = typer.Typer(help="The topic catalog (topics/*.yaml).", no_args_is_help=True)
model_app = typer.Typer(help="Local models for tests and demos (no hub downloads).", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(local_app, name="local")
app.add_typer(topics_app, name="topics")
from rollart.cli.bench import bench_app  # noqa: E402 - after the apps they join
from rollart.cli.chaos import register as register_chaos  # noqa: E402
from rollart.cli.deploy import deploy_app  # noqa: E402

app.add_typer(bench_app, name="bench")

register_chaos(app)

app.add_typer(deploy_app, name="deploy")

# The commands that start a stack and stages of their own. Stopped by SIGTERM (`timeout`, a CI job's
# cancel, systemd) they must unwind as on Ctrl-C, so that their context managers stop what they
# started: Python's default SIGTERM ends the process on the spot. (A SIGKILL unwinds nothing: there,
# the kernel's PR_SET_PDEATHSIG takes the stages and the stack's services down; see rollart.local.)
RUNNERS = frozenset({"run", "rollout", "chaos", "soak", "bench"})


def sigterm_as_sigint() -> Callable[[], object]:
    """Have SIGTERM do what SIGINT does at that moment: inside asyncio.run, cancel the main task (a
    second signal raises KeyboardInterrupt); elsewhere raise KeyboardInterrupt. Returns the undo."""
    def handler(signum, frame) -> None:
        on_sigint = signal.getsignal(signal.SIGINT)
        if not callable(on_sigint):  # SIGINT ignored (a backgrounded job): SIGTERM must still stop us
            raise KeyboardInterrupt
        on_sigint(signal.SIGINT, frame)

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


@app.callback()
def _root(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand in RUNNERS and threading.current_thread() is threading.main_thread():
        ctx.call_on_close(sigterm_as_sigint())  # undone after the command (it may run in a test's process)

console = Console()
err_console = Console(stderr=True)

from rollart.cli.options import BrokerOption, ConfigOption  # noqa: E402


def _config(path: Path | None) -> RollartConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


def _with_job(config: RollartConfig, job: str) -> RollartConfig:
    """``--job`` over the config's job, validated like the config's own (a bad name exits 2, naming it)."""
    try:
        return config.with_updates("--job", job=job)
    except ConfigError as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


def _run(coro):
    try:
        return asyncio.run(coro)
    except NoEndpointError as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None


# -- local stack -------------------------------------------------------------------------------------


@local_app.command("up")
def local_up_cmd(config: ConfigOption = None,
                 embedded_redis: Annotated[bool, typer.Option(help="Start Valkey even if a Redis answers.")] = False,
                 broker: BrokerOption = None,
                 as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Start the broker (and Redis if none answers), record the endpoints, create the job's topics."""
    from rollart.local.brokers import BrokerUnavailable
    from rollart.local.stack import DEFAULT_REDIS_URL, local_up
    from rollart.topics.admin import apply_topics
    from rollart.endpoints import resolve_endpoints

    cfg = _config(config)
    try:
        state, started = local_up(redis_url=cfg.redis.url or DEFAULT_REDIS_URL, force_embedded_redis=embedded_redis,
                                  broker=broker)
    except (BrokerUnavailable, RuntimeError) as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    _run(apply_topics(cfg, resolve_endpoints(cfg)))  # idempotent: a restarted Kafka still has its topics
    if as_json:
        print(json.dumps({"kafka_bootstrap": state.kafka_bootstrap, "redis_url": state.redis_url,
                          "started": started, "broker_pid": state.broker_pid, "redis_pid": state.redis_pid,
                          "broker": {"kind": state.broker_kind, "version": state.broker_version},
                          "broker_dir": state.broker_dir}))
        return
    console.print(f"{'started' if started else 'already running'}: local stack")
    console.print(f"  kafka  {state.kafka_bootstrap}  ({_broker_words(state)}, pid {state.broker_pid})")
    redis_owner = f"pid {state.redis_pid}" if state.redis_pid else "existing server, not managed"
    console.print(f"  redis  {state.redis_url}  ({redis_owner})")
    console.print(f"  topics of job {cfg.job!r} applied; logs in {state.log_dir}")


def _broker_words(state) -> str:
    if state.broker_kind == "kafka":
        return f"Apache Kafka {state.broker_version}, log in {state.broker_dir}"
    return f"Tansu {state.broker_version}, in memory"


@local_app.command("down")
def local_down_cmd(wipe: Annotated[bool, typer.Option(help="Also delete Apache Kafka's log (every topic of "
                                                           "every local job).")] = False) -> None:
    """Stop the local stack started by `rollart local up` (Apache Kafka's log stays for the next up)."""
    from rollart.local.stack import local_down

    state = local_down(wipe=wipe)
    console.print("stopped the local stack" if state else "no local stack is recorded")
    if wipe:
        console.print("deleted the local Apache Kafka log")


@local_app.command("status")
def local_status_cmd(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Show the recorded local stack, which broker it runs, and whether it is alive."""
    from dataclasses import asdict

    from rollart.local.stack import StackState

    state = StackState.read()
    alive = bool(state and state.alive())
    if as_json:
        print(json.dumps({"alive": alive, **(asdict(state) if state else {})}))
    elif state is None:
        console.print("no local stack is recorded")
    else:
        console.print(f"{'alive' if alive else 'DEAD'}: kafka {state.kafka_bootstrap} ({_broker_words(state)}), "
                      f"redis {state.redis_url}" + ("" if alive else f"; not running: {', '.join(state.dead())}"))
    raise typer.Exit(0 if alive else 1)


@local_app.command("kafka-tool", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def local_kafka_tool_cmd(ctx: typer.Context,
                         tool: Annotated[str, typer.Argument(
                             help="kafka-consumer-groups | kafka-topics | kafka-console-consumer | kafka-get-offsets")],
                         ) -> None:
    """Run one of Apache Kafka's own tools against the local broker (--bootstrap-server is added), e.g.
    `rollart local kafka-tool kafka-consumer-groups --describe --all-groups`."""
    import subprocess

    from rollart.local.brokers import BrokerUnavailable, kafka_tool_argv
    from rollart.local.stack import StackState

    state = StackState.read()
    if state is None or not state.alive() or state.broker_kind != "kafka":
        err_console.print("[red]no local Apache Kafka is running: start it with `rollart local up`[/red]")
        raise typer.Exit(1)
    try:
        argv = kafka_tool_argv(tool, "--bootstrap-server", state.kafka_bootstrap, *ctx.args)
    except (BrokerUnavailable, ValueError) as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    raise typer.Exit(subprocess.run(argv).returncode)


# -- topics ------------------------------------------------------------------------------------------


@topics_app.command("apply")
def topics_apply_cmd(config: ConfigOption = None,
                     strict: Annotated[bool, typer.Option(help="Exit 1 when existing topics differ.")] = False) -> None:
    """Create missing topics of the job (idempotent) and report how existing ones differ."""
    from rollart.endpoints import resolve_endpoints
    from rollart.topics.admin import apply_topics

    cfg = _config(config)
    reports = _run(apply_topics(cfg, resolve_endpoints(cfg)))
    table = Table("topic", "action", "differences")
    for r in reports:
        colour = {"created": "green", "exists": "dim", "differs": "yellow"}[r.action]
        table.add_row(r.name, f"[{colour}]{r.action}[/{colour}]", "; ".join(r.differences))
    console.print(table)
    if strict and any(r.action == "differs" for r in reports):
        raise typer.Exit(1)


@topics_app.command("list")
def topics_list_cmd(config: ConfigOption = None) -> None:
    """Print the catalog expanded for the job (pools, prefix, DLQs)."""
    from rollart.topics import expand_catalog

    cfg = _config(config)
    table = Table("topic", "partitions", "cleanup", "retention.ms", "key", "kinds")
    for t in expand_catalog(cfg):
        spec = t.spec
        table.add_row(t.name, str(t.partitions), t.configs["cleanup.policy"], t.configs["retention.ms"],
                      "-" if t.is_dlq else spec.key, "raw bytes + error headers" if t.is_dlq else ", ".join(spec.kinds))
    console.print(table)


# -- doctor ------------------------------------------------------------------------------------------


@app.command("doctor")
def doctor_cmd(config: ConfigOption = None, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Check the broker, topics, Redis, the version store (and Mooncake); round-trip every message kind."""
    from rollart.doctor import doctor_json, run_doctor

    ok, checks, broker = asyncio.run(run_doctor(_config(config)))
    if as_json:
        print(json.dumps(doctor_json(ok, checks, broker)))
    else:
        table = Table("check", "result", "latency", "detail")
        for c in checks:
            table.add_row(c.name, "[green]ok[/green]" if c.ok else "[red]FAIL[/red]", f"{c.latency_s * 1000:.1f} ms",
                          c.detail)
        console.print(table)
        if broker is not None:
            console.print(f"broker: {broker['kind']} {broker['version'] or '(version unknown)'}")
        console.print("[green]all checks passed[/green]" if ok else "[red]some checks failed; see details[/red]")
    raise typer.Exit(0 if ok else 1)


# -- benchmarks --------------------------------------------------------------------------------------


BenchBrokerOption = Annotated[Optional[str], typer.Option(
    "--broker", help="kafka | tansu | both: measure on a throw-away local stack of that broker (both: one "
                     "after the other, side by side). Default: the configured or running stack.")]


@bench_app.command("bus")
def bench_bus_cmd(config: ConfigOption = None, as_json: Annotated[bool, typer.Option("--json")] = False,
                  messages: int = 20_000, tokens: int = 64, roundtrips: int = 300,
                  fill: Annotated[int, typer.Option(help="Records added to the round trip's partitions between growth "
                                                       "measurements.")] = 50_000,
                  fill_steps: Annotated[int, typer.Option(help="Growth measurements (0: none).")] = 0,
                  broker: BenchBrokerOption = None,
                  out: Annotated[Optional[Path], typer.Option(help="Also write the JSON here.")] = None) -> None:
    """Produce and consume msgs/s and the produce→consume→produce→consume round trip p50/p99; with
    --fill-steps, the round trip again after every --fill more records are stored."""
    import tempfile

    from rollart.bench.brokers import on_local_stack, per_broker
    from rollart.bench.bus import bench_bus

    cfg = _config(config)
    options = dict(messages=messages, tokens=tokens, roundtrips=roundtrips, fill=fill, fill_steps=fill_steps)

    async def on(kind) -> dict:
        with tempfile.TemporaryDirectory(prefix="rollart-bench-bus-") as work, \
                on_local_stack(cfg, kind, Path(work)) as local:
            return await bench_bus(local, **options)

    try:
        result = _run(bench_bus(cfg, **options) if broker is None else per_broker(broker, on))
    except ValueError as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if out:
        out.write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result))
        return
    console.print(_bus_table(result.get("brokers") or {result.get("broker", "configured"): result}))


def _bus_table(results: dict[str, dict]) -> Table:
    table = Table("figure", *results)
    rows = [("produce (msgs/s)", lambda r: f"{r['produce_msgs_per_s']:,.0f}"),
            ("consume, ConsumerLoop (msgs/s)", lambda r: f"{r['consume_msgs_per_s']:,.0f}"),
            ("round trip p50 (ms)", lambda r: f"{r['roundtrip_p50_s'] * 1000:.2f}"),
            ("round trip p99 (ms)", lambda r: f"{r['roundtrip_p99_s'] * 1000:.2f}")]
    for name, cell in rows:
        table.add_row(name, *(cell(r) for r in results.values()))
    first = next(iter(results.values()))
    for i, row in enumerate(first["growth"]):
        cells = [r["growth"][i] for r in results.values()]
        table.add_row(f"round trip p50 / p99 (ms), {row['records_per_partition']:,} records per partition",
                      *(f"{c['roundtrip_p50_s'] * 1000:.2f} / {c['roundtrip_p99_s'] * 1000:.2f}" for c in cells))
    return table


# -- stages ------------------------------------------------------------------------------------------



@app.command("consume")
def consume_cmd(stage: Annotated[str, typer.Argument(help=" | ".join(STAGE_NAMES))],
                config: ConfigOption = None,
                pool: Annotated[Optional[str], typer.Option(help="Generation pool (generation only).")] = None,
                resume: Annotated[bool, typer.Option(help="Trainer: continue from the latest checkpoint.")] = False,
                ) -> None:
    """Run one member of a stage until SIGTERM."""
    from rollart.stages import STAGES

    cfg = _config(config)
    spec = STAGES.get(stage)
    if spec is None:
        err_console.print(f"[red]unknown stage {stage!r}; choose one of {', '.join(STAGES)}[/red]")
        raise typer.Exit(2)
    if spec.per_pool != (pool is not None):
        err_console.print(f"[red]--pool is required for {stage} and only for a stage per pool[/red]" if spec.per_pool
                          else f"[red]--pool is for a stage per pool (generation), not {stage}[/red]")
        raise typer.Exit(2)
    if resume and "resume" not in spec.options:
        err_console.print(f"[red]--resume is for the trainer only, not {stage}[/red]")
        raise typer.Exit(2)
    logging.getLogger("rollart").setLevel(logging.INFO)
    # a crash in native code (vLLM, torch, Mooncake) prints every thread's Python stack to the stage's log
    if not faulthandler.is_enabled() and sys.__stderr__ is not None:
        faulthandler.enable(sys.__stderr__)
    from rollart.stages import entry

    try:
        _run(entry(stage, cfg, pool, resume=resume))
    except ValueError as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if spec.exit_at_stop:
        from rollart.bus.stopping import exit_without_teardown

        exit_without_teardown(0)


@model_app.command("init-tiny")
def model_init_tiny_cmd(out: Annotated[Path, typer.Option(help="Directory to write the model to.")],
                        hidden: int = 128, layers: int = 2, heads: int = 2, seed: int = 0) -> None:
    """Create a tiny random Qwen2 model with a tokenizer trained on the built-in envs' text."""
    from rollart.models.tiny import init_tiny_model

    path = init_tiny_model(out, hidden=hidden, layers=layers, heads=heads, seed=seed)
    console.print(f"wrote a tiny Qwen2 model (hidden {hidden}, {layers} layers, {heads} heads) to {path}")


@app.command("rollout")
def rollout_cmd(config_path: Annotated[Path, typer.Argument(help="Job config YAML.")],
                trajectories: Annotated[int, typer.Option(min=1)] = 32,
                out: Annotated[Path, typer.Option()] = Path("out/rollout"),
                timeout: Annotated[float, typer.Option(help="Seconds before giving up.")] = 900.0,
                env_members: int = 1, gen_members: int = 1, broker: BrokerOption = None,
                secure: Annotated[bool, typer.Option(help="On the run's own Apache Kafka with SASL_SSL (SCRAM) and "
                                                          "ACLs: each stage logs in as its own user.")] = False,
                ) -> None:
    """Start the stack and every stage as processes; collect N scored trajectories; write summary.json."""
    from rollart.job.rollout import rollout

    cfg = _config(config_path)
    try:
        summary = _run(rollout(config_path, cfg, trajectories=trajectories, out=out, timeout_s=timeout,
                               env_members=env_members, gen_members=gen_members, secure=secure))
    except ConfigError as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    table = Table("tag", "completed", "share", "reward mean", "turns mean", "success")
    for tag, row in summary["by_tag"].items():
        share = "-" if row.get("share") is None else f"{row['share']} ({'met' if row['completed'] >= row['share'] else 'short'})"
        table.add_row(tag, str(row["completed"]), share, f"{row['reward_mean']:.3f}", f"{row['turns_mean']:.2f}",
                      f"{row['success_rate']:.0%}")
    console.print(table)
    console.print(f"completed {summary['completed']}, aborted {summary['aborted']}, "
                  f"{summary['tokens_generated']} tokens generated in {summary['elapsed_s']:.1f}s; "
                  f"job {summary['job']}; summary in {out / 'summary.json'}")


@app.command("export")
def export_cmd(checkpoint: Annotated[Path, typer.Argument(help="A step-N checkpoint, a checkpoints folder or a "
                                                               "`rollart run --out` folder (its latest step).")],
               out: Annotated[Path, typer.Option(help="The Hugging Face model directory to write.")],
               config: ConfigOption = None,
               base_model: Annotated[Optional[Path], typer.Option(help="The run's base model directory "
                                                                       "(default: the config's model.path).")] = None,
               ) -> None:
    """Write a trainer checkpoint as a Hugging Face model directory (config, safetensors, tokenizer)."""
    from rollart.training.export import export_checkpoint

    base = base_model or _config(config).model.path
    try:
        info = export_checkpoint(checkpoint, base, out)
    except (ValueError, OSError) as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    console.print(f"step {info['step']} (policy version {info['version']}, {info['parameters']:,} parameters) "
                  f"of {info['checkpoint']} -> {out}")


@app.command("eval")
def eval_cmd(config_path: Annotated[Path, typer.Argument(help="Job config YAML with an eval: section.")],
             checkpoint: Annotated[Path, typer.Option(help="A step-N checkpoint, a checkpoints folder, a `rollart run "
                                                          "--out` folder (its latest step) or a Hugging Face model "
                                                          "directory.")],
             out: Annotated[Optional[Path], typer.Option(help="Also write the summary (with every trajectory) "
                                                              "here as JSON.")] = None,
             as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Evaluate one checkpoint on the job's held-out eval tasks, offline (an engine in this process)."""
    from rollart.evaluation.offline import evaluate_checkpoint

    cfg = _config(config_path)
    try:
        row = _run(evaluate_checkpoint(cfg, checkpoint))
    except (ConfigError, ValueError, OSError) as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(row, indent=1))
    if as_json:
        print(json.dumps({k: v for k, v in row.items() if k != "trajectories"}))
        return
    table = Table(title=f"eval of {checkpoint} (policy version {row['version']}, step {row['step']}, "
                        f"{row['seconds']:.0f}s)")
    for column in ("tag", "tasks", "scored", "failed", "success", "reward", "turns"):
        table.add_column(column, justify="left" if column == "tag" else "right")
    for tag, r in row["tags"].items():
        table.add_row(tag, str(r["tasks"]), str(r["scored"]), str(r["failed"]), f"{r['success_rate']:.0%}",
                      f"{r['reward_mean']:+.3f}", f"{r['turns_mean']:.2f}")
    console.print(table)


@app.command("report")
def report_cmd(out: Annotated[Path, typer.Argument(help="A `rollart run --out` folder.")] = Path("out/run")) -> None:
    """Rebuild OUT/report.json and report.png from the run's record (an interrupted or killed run)."""
    from rollart.job.report import rebuild_report

    try:
        report = rebuild_report(out)
    except ValueError as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    console.print(f"{len(report['steps'])} steps of job {report['job']}; reward "
                  f"{report['reward_first_steps'] if report['steps'] else float('nan'):+.3f} (first steps) -> "
                  f"{report['reward_last_steps'] if report['steps'] else float('nan'):+.3f} (last steps); "
                  f"{out / 'report.json'}")


@app.command("run")
def run_cmd(config_path: Annotated[Path, typer.Argument(help="Job config YAML.")],
            steps: Annotated[int, typer.Option(min=1, help="Training steps.")] = 60,
            out: Annotated[Path, typer.Option(help="Report, checkpoints and logs go here.")] = Path("out/run"),
            resume: Annotated[bool, typer.Option(help="Continue the run recorded in OUT (needs a persistent "
                                                      "broker: configured endpoints or `rollart local up`).")] = False,
            timeout: Annotated[float, typer.Option(help="Seconds before giving up.")] = 3600.0,
            env_members: int = 1, gen_members: int = 1, broker: BrokerOption = None) -> None:
    """Train end to end: every stage as a process; live progress; OUT/report.json and report.png."""
    from rollart.job.run import RunOptions, run_job

    cfg = _config(config_path)

    def progress(row: dict) -> None:
        console.print(f"step {row['step']:>4}/{row['target']}  reward {row['reward_mean']:+.3f}  "
                      f"success {row['success_rate']:>4.0%}  staleness<={row['staleness_max']}  "
                      f"samples {row['samples']}  train {row['train_s']:.2f}s  wait {row['wait_s']:.2f}s  "
                      f"trajectories {row['completed']} (aborted {sum(row['aborted'].values())})")

    try:
        report = _run(run_job(config_path, cfg, RunOptions(steps=steps, out=out, resume=resume, timeout_s=timeout,
                                                           env_members=env_members, gen_members=gen_members,
                                                           progress=progress)))
    except ConfigError as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    w = report["weights"]
    console.print(f"reward {report['reward_first_steps']:+.3f} (first steps) -> {report['reward_last_steps']:+.3f} "
                  f"(last steps); success {report['success_first_steps']:.0%} -> {report['success_last_steps']:.0%}")
    console.print(f"{len(report['steps'])} steps in {report['elapsed_s']:.0f}s, {report['tokens_per_s']:.0f} tokens/s, "
                  f"max staleness {report['staleness_max']} (alpha {report['alpha']}), "
                  f"duplicates trained {report['trained_duplicates']}; weights via {w['transport']}: publish "
                  f"{w['publish_s'].get('mean', 0):.3f}s, pull {w['pull_s'].get('mean', 0):.3f}s, "
                  f"exposed load {w['load_s'].get('mean', 0):.3f}s (means)")
    console.print(f"report: {out / 'report.json'}, {out / 'report.png'}")


@app.command("scale")
def scale_cmd(job: Annotated[str, typer.Argument(help="The running job (a run's job: OUT/run.json).")],
              stage: Annotated[str, typer.Argument(help="A stage with several members: env, reward, generation.")],
              members: Annotated[int, typer.Argument(help="Members to keep.")],
              pool: Annotated[Optional[str], typer.Option(help="The generation pool (generation scales per pool).")] = None,
              config: ConfigOption = None,
              run: Annotated[Optional[Path], typer.Option(help="The run's OUT folder: reach the stack it started "
                                                               "itself (no `rollart local up`).")] = None) -> None:
    """Grow or shrink a stage of a running local job; its supervisor applies it within a second (new
    members join the groups; leaving ones drain, commit and hand their partitions over)."""
    from rollart.endpoints import Endpoints, resolve_endpoints
    from rollart.job.scale import ScaleRequest, request_scale
    from rollart.local.stack import STACK_FILE, StackState
    from rollart.state import connect_redis

    cfg = _with_job(_config(config), job)
    own = StackState.read(run / "stack" / STACK_FILE) if run is not None else None

    async def send() -> None:
        endpoints = (Endpoints(own.kafka_bootstrap, own.redis_url, "the run's stack") if own is not None
                     else resolve_endpoints(cfg))
        redis = connect_redis(endpoints)
        try:
            await request_scale(redis, cfg, ScaleRequest(stage, members, pool))
        finally:
            await redis.aclose()

    try:
        _run(send())
    except ConfigError as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    console.print(f"{cfg.job}: {stage}{f' ({pool})' if pool else ''} -> {members} member(s) requested")


@app.command("lag")
def lag_cmd(config: ConfigOption = None, as_json: Annotated[bool, typer.Option("--json")] = False,
            job: Annotated[Optional[str], typer.Option(help="Job to inspect (e.g. a run's job).")] = None,
            watch: Annotated[Optional[float], typer.Option(help="Refresh every N seconds until Ctrl-C.")] = None,
            metrics_port: Annotated[Optional[int], typer.Option(help="Serve the lag as Prometheus metrics.")] = None,
            ) -> None:
    """Every consumer group's lag per topic and partition (end offset minus committed offset)."""
    import time as _time

    from rollart.endpoints import resolve_endpoints
    from rollart.lag import consumer_lag

    cfg = _config(config)
    if job:
        cfg = _with_job(cfg, job)
    if metrics_port is not None:
        from rollart.metrics import serve_metrics

        serve_metrics(metrics_port, cfg.metrics.host)
    async def once():
        return await consumer_lag(cfg, resolve_endpoints(cfg))

    while True:
        rows = _run(once())
        if as_json:
            print(json.dumps([{"group": r.group, "topic": r.topic, "partition": r.partition, "committed": r.committed,
                               "end": r.end, "lag": r.lag} for r in rows]))
        else:
            table = Table("group", "topic", "partition", "committed", "end", "lag")
            for r in rows:
                table.add_row(r.group, r.topic, str(r.partition), "-" if r.committed is None else str(r.committed),
                              str(r.end), str(r.lag))
            console.print(table)
            console.print(f"total lag {sum(r.lag for r in rows)} (job {cfg.job})")
        if watch is None:
            return
        _time.sleep(watch)


@app.command("replay")
def replay_cmd(config: ConfigOption = None,
               topic: Annotated[str, typer.Option(help="Logical topic, e.g. rewards.results.")] = REWARDS_RESULTS,
               traj: Annotated[Optional[str], typer.Option(help="Only this trajectory id.")] = None,
               from_offset: Annotated[Optional[int], typer.Option(help="Start at this offset.")] = None,
               partition: Optional[int] = None,
               since: Annotated[Optional[float], typer.Option(help="Unix seconds: from this time.")] = None,
               until: Annotated[Optional[float], typer.Option(help="Unix seconds: up to this time.")] = None,
               limit: Optional[int] = None, as_json: Annotated[bool, typer.Option("--json")] = False,
               job: Annotated[Optional[str], typer.Option(help="Job to read (e.g. a rollout's run job).")] = None,
               tag: Annotated[Optional[str], typer.Option(help="Only this task tag.")] = None,
               min_reward: Annotated[Optional[float], typer.Option(help="Only rewards >= this.")] = None,
               max_reward: Annotated[Optional[float], typer.Option(help="Only rewards <= this.")] = None,
               abort_reason: Annotated[Optional[str], typer.Option(help="Only aborts with this reason.")] = None,
               policy_version: Annotated[Optional[int], typer.Option(help="Only messages of this policy version.")] = None,
               kind: Annotated[Optional[str], typer.Option(help="Only this message kind, e.g. ScoredTrajectory "
                                                                "(rewards.results also carries GroupEnded, Abort).")]
               = None,
               follow: Annotated[bool, typer.Option(help="With --traj: the trajectory's history across every "
                                                         "topic (task, turns, aborts, completion, score).")] = False,
               refeed_to: Annotated[Optional[str], typer.Option(help="Copy the selected messages into this job's "
                                                                     "topic, exactly once (the source is untouched).")] = None,
               refeed_topic: Annotated[Optional[str], typer.Option(help="Destination topic (default: --topic).")] = None,
               ) -> None:
    """Print a topic's trajectories decoded to text (or JSONL with --json); follow one trajectory
    across topics (--follow); re-feed selected messages into a new job (--refeed-to)."""
    from rollart.endpoints import resolve_endpoints
    from rollart.replay import ReplayFilter, render_text, replay, to_json

    cfg = _config(config)
    if job:
        cfg = _with_job(cfg, job)
    tokenizer = _tokenizer(cfg)
    flt = ReplayFilter(traj_id=traj, from_offset=from_offset, partition=partition, limit=limit,
                       since_ms=int(since * 1000) if since else None, until_ms=int(until * 1000) if until else None,
                       tag=tag, min_reward=min_reward, max_reward=max_reward, abort_reason=abort_reason,
                       policy_version=policy_version, kind=kind)

    if follow:
        _follow_trajectory(cfg, traj, as_json, tokenizer)
        return
    if refeed_to:
        _refeed(cfg, topic, flt, refeed_to, refeed_topic, as_json)
        return

    async def go() -> int:
        n = 0
        async for record, message in replay(cfg, resolve_endpoints(cfg), topic, flt):
            print(to_json(tokenizer, record, message) if as_json else render_text(tokenizer, record, message))
            n += 1
        return n

    if _run(go()) == 0 and not as_json:
        err_console.print(f"no records in {cfg.job}.{topic} match")


def _follow_trajectory(cfg: RollartConfig, traj: str | None, as_json: bool, tokenizer) -> None:
    from rollart.endpoints import resolve_endpoints
    from rollart.replay import to_json
    from rollart.trace import describe, trace

    if not traj:
        err_console.print("[red]--follow needs --traj[/red]")
        raise typer.Exit(2)
    entries = _run(trace(cfg, resolve_endpoints(cfg), traj))
    if not entries:
        err_console.print(f"[red]no record of trajectory {traj} in job {cfg.job}[/red]")
        raise typer.Exit(1)
    for entry in entries:
        print(to_json(tokenizer, entry.record, entry.message) if as_json else describe(entry))


def _refeed(cfg: RollartConfig, topic: str, flt, to_job: str, to_topic: str | None, as_json: bool) -> None:
    from rollart.endpoints import resolve_endpoints
    from rollart.refeed import refeed

    try:
        result = _run(refeed(cfg, resolve_endpoints(cfg), topic, flt, to_job=to_job, to_topic=to_topic))
    except (ValueError, KeyError) as exc:
        err_console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(result.__dict__))
        return
    console.print(f"{result.selected} selected from {cfg.job}.{topic}: {result.produced} produced to "
                  f"{to_job}.{to_topic or topic}, {result.already_there} already there, "
                  f"{result.skipped_undecodable} undecodable skipped")


def _tokenizer(cfg: RollartConfig):
    from rollart.replay import load_decoder

    return load_decoder(cfg.model.path)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()
