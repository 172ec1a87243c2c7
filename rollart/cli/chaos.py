"""Reliability commands: ``rollart chaos`` (train under faults, then audit) and ``rollart soak`` (hold a
steady stream, report memory growth per stage)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from rollart.chaos.run import FAULTS
from rollart.cli.options import BrokerOption

console = Console()


def chaos_cmd(config_path: Annotated[Optional[Path], typer.Argument(help="Job config YAML (default: a "
                                                                          "small FrozenLake job).")] = None,
              faults: Annotated[str, typer.Option(help="Comma-separated: " + ",".join(FAULTS))] = ",".join(FAULTS),
              steps: Annotated[int, typer.Option(min=2)] = 30,
              interval: Annotated[float, typer.Option(help="Seconds between injected faults.")] = 20.0,
              seed: int = 0,
              schedule: Annotated[Optional[str], typer.Option(help="Injected faults in this order instead of "
                                                                   "at random, e.g. kill:trainer,redis-flush,"
                                                                   "bad-messages,kill:generation")] = None,
              baseline_steps: Annotated[int, typer.Option(min=0, help="Steps of the same job without faults "
                                                                     "first, for goodput_ratio (0: none).")] = 10,
              stall_limit: Annotated[float, typer.Option(min=1, help="Seconds without a training step that "
                                                                    "fail the audit.")] = 300.0,
              env_failure_rate: Annotated[float, typer.Option(min=0, max=1, help="Per env step, of env-hang "
                                                                               "and of env-raise.")] = 0.01,
              out: Annotated[Path, typer.Option(help="Result JSON; the run's files go beside it.")]
              = Path("out/chaos/result.json"), broker: BrokerOption = None) -> None:
    """Kill stages, flush Redis, break envs and rewards, inject bad records; audit every trajectory
    and report goodput (trained per minute under faults ÷ fault-free)."""
    from rollart.chaos.run import run_chaos

    if out.is_dir() or out.name == "run":
        Console(stderr=True).print(f"[red]--out {out}: the result JSON's path, not a directory (the run's files "
                                   "go beside it, in run/)[/red]")
        raise typer.Exit(2)
    wanted = {f.strip() for f in faults.split(",") if f.strip()}
    order = [f.strip() for f in schedule.split(",") if f.strip()] if schedule else None
    try:
        result = asyncio.run(run_chaos(config_path, wanted, steps=steps, out=out.parent / "run",
                                       interval_s=interval, seed=seed, schedule=order,
                                       baseline_steps=baseline_steps, stall_limit_s=stall_limit,
                                       env_failure_rate=env_failure_rate))
    except ValueError as exc:
        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    table = Table("figure", "value", title="chaos")
    for key in ("faults_injected", "faults_survived", "trajectories_lost", "duplicates_trained", "stages_alive",
                "steps", "trained_per_min", "fault_free_trained_per_min", "goodput_ratio"):
        table.add_row(key, str(result[key]))
    table.add_row("replacement rollouts", str(result["audit"]["replacements"]))
    table.add_row("longest stall (s)", str(result["audit"]["longest_stall_s"]))
    for topic, copies in result["duplicates_produced"].items():
        table.add_row(f"duplicates produced: {topic}", str(copies))
    for kind, seconds in result["recovery_s"].items():
        table.add_row(f"recovery {kind} (s)", f"{seconds:.1f}")
    table.add_row("audit holds", str(result["audit"]["holds"]))
    console.print(table)
    console.print(f"result: {out}")
    if result["driver_error"]:
        Console(stderr=True).print(f"[red]fault injection failed: {result['driver_error']}[/red]")
    if not result["audit"]["holds"] or not result["stages_alive"] or result["driver_error"]:
        raise typer.Exit(1)


def soak_cmd(config_path: Annotated[Optional[Path], typer.Argument(help="Job config YAML (default: a small "
                                                                         "FrozenLake job).")] = None,
             minutes: Annotated[float, typer.Option(min=0.5, help="How long to hold the stream.")] = 20.0,
             warmup: Annotated[float, typer.Option(help="Seconds of each process's start not judged "
                                                        "(model load, engine warm-up).")] = 120.0,
             sample: Annotated[float, typer.Option(min=0.5, help="Seconds between memory samples.")] = 5.0,
             out: Annotated[Path, typer.Option(help="Result JSON; the run's files go beside it.")]
             = Path("out/soak/result.json"), broker: BrokerOption = None) -> None:
    """Hold a steady training stream and report each stage's memory growth (it must be flat)."""
    from rollart.chaos.soak import run_soak

    try:
        result = asyncio.run(run_soak(config_path, duration_s=minutes * 60, out=out.parent / "run",
                                      sample_s=sample, warmup_s=warmup))
    except ValueError as exc:
        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    table = Table("stage", "baseline MiB", "end MiB", "growth MiB", "growth %", "slope MiB/h", "restarts", "flat",
                  title=f"soak: {minutes:g} min, {result['steps']} steps, "
                        f"{result['trajectories_trained']} trajectories trained")
    for name, row in result["stages"].items():
        table.add_row(name, *(str(row.get(k, "-")) for k in ("baseline_mib", "end_mib", "growth_mib", "growth_pct",
                                                              "slope_mib_per_h", "restarts", "flat")))
    console.print(table)
    console.print("throughput (trajectories/min): " + ", ".join(
        f"{w['from_s']}s {w['trajectories_per_min']}" for w in result["throughput"]))
    console.print("per-turn overhead, mean / p50 ms: " + ", ".join(
        f"{w['from_s']}s {w['mean_s'] * 1000:.1f} / {(w.get('p50_s') or 0) * 1000:.1f}"
        for w in result["turn_overhead"] if w["mean_s"] is not None))
    drift = result["overhead_drift"]
    if drift:
        console.print(f"overhead drift (last fifth / first fifth of {drift['windows_judged']} whole windows after "
                      f"the warm-up): {drift['ratio']}")
    else:
        console.print("overhead drift: fewer than 2 whole windows after the warm-up (a longer --minutes)")
    console.print(f"result: {out}")
    if not result["flat"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("chaos")(chaos_cmd)
    app.command("soak")(soak_cmd)
