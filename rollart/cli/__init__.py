"""The ``rollart`` command."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from rollart.config import ConfigError, RollartConfig, load_config
from rollart.endpoints import NoEndpointError

app = typer.Typer(help="rollart: disaggregated multi-task agentic RL on Kafka consumer groups.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
local_app = typer.Typer(help="The embedded local stack (Kafka-protocol broker + Redis).", no_args_is_help=True)
topics_app = typer.Typer(help="The topic catalog (topics/*.yaml).", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print their figures.", no_args_is_help=True)
app.add_typer(local_app, name="local")
app.add_typer(topics_app, name="topics")
app.add_typer(bench_app, name="bench")

console = Console()
err_console = Console(stderr=True)

ConfigOption = Annotated[Optional[Path], typer.Option("--config", "-c", help="Job config YAML (env ROLLART_* overrides).")]


def _config(path: Path | None) -> RollartConfig:
    try:
        return load_config(path)
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
                 as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Start the broker (and Redis if none answers), record the endpoints, create the job's topics."""
    from rollart.local.stack import DEFAULT_REDIS_URL, local_up
    from rollart.topics.admin import apply_topics
    from rollart.endpoints import resolve_endpoints

    cfg = _config(config)
    state, started = local_up(redis_url=cfg.redis.url or DEFAULT_REDIS_URL, force_embedded_redis=embedded_redis)
    _run(apply_topics(cfg, resolve_endpoints(cfg)))
    if as_json:
        print(json.dumps({"kafka_bootstrap": state.kafka_bootstrap, "redis_url": state.redis_url,
                          "started": started, "broker_pid": state.broker_pid, "redis_pid": state.redis_pid}))
        return
    console.print(f"{'started' if started else 'already running'}: local stack")
    console.print(f"  kafka  {state.kafka_bootstrap}  (pid {state.broker_pid})")
    redis_owner = f"pid {state.redis_pid}" if state.redis_pid else "existing server, not managed"
    console.print(f"  redis  {state.redis_url}  ({redis_owner})")
    console.print(f"  topics of job {cfg.job!r} applied; logs in {state.log_dir}")


@local_app.command("down")
def local_down_cmd() -> None:
    """Stop the local stack started by `rollart local up`."""
    from rollart.local.stack import local_down

    state = local_down()
    console.print("stopped the local stack" if state else "no local stack is recorded")


@local_app.command("status")
def local_status_cmd(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Show the recorded local stack and whether it is alive."""
    from dataclasses import asdict

    from rollart.local.stack import StackState

    state = StackState.read()
    alive = bool(state and state.alive())
    if as_json:
        print(json.dumps({"alive": alive, **(asdict(state) if state else {})}))
    elif state is None:
        console.print("no local stack is recorded")
    else:
        console.print(f"{'alive' if alive else 'DEAD'}: kafka {state.kafka_bootstrap}, redis {state.redis_url}")
    raise typer.Exit(0 if alive else 1)


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

    ok, checks = asyncio.run(run_doctor(_config(config)))
    if as_json:
        print(json.dumps(doctor_json(ok, checks)))
    else:
        table = Table("check", "result", "latency", "detail")
        for c in checks:
            table.add_row(c.name, "[green]ok[/green]" if c.ok else "[red]FAIL[/red]", f"{c.latency_s * 1000:.1f} ms",
                          c.detail)
        console.print(table)
        console.print("[green]all checks passed[/green]" if ok else "[red]some checks failed; see details[/red]")
    raise typer.Exit(0 if ok else 1)


# -- benchmarks --------------------------------------------------------------------------------------


@bench_app.command("bus")
def bench_bus_cmd(config: ConfigOption = None, as_json: Annotated[bool, typer.Option("--json")] = False,
                  messages: int = 20_000, tokens: int = 64, roundtrips: int = 300,
                  out: Annotated[Optional[Path], typer.Option(help="Also write the JSON here.")] = None) -> None:
    """Produce and consume msgs/s and the produce→consume→produce→consume round trip p50/p99."""
    from rollart.bench.bus import bench_bus

    result = _run(bench_bus(_config(config), messages=messages, tokens=tokens, roundtrips=roundtrips))
    if out:
        out.write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result))
        return
    table = Table("figure", "value")
    table.add_row("produce", f"{result['produce_msgs_per_s']:,.0f} msgs/s")
    table.add_row("consume (ConsumerLoop)", f"{result['consume_msgs_per_s']:,.0f} msgs/s")
    table.add_row("round trip p50", f"{result['roundtrip_p50_s'] * 1000:.2f} ms")
    table.add_row("round trip p99", f"{result['roundtrip_p99_s'] * 1000:.2f} ms")
    console.print(table)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()
