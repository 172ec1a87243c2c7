"""``rollart deploy render | apply | status``: a job on Kubernetes (see rollart.deploy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from rollart.config import ConfigError, RollartConfig, load_config

deploy_app = typer.Typer(help="Run a job on Kubernetes: render manifests, apply them, show status.",
                         no_args_is_help=True)

ConfigArg = Annotated[Path, typer.Argument(help="Job config YAML (its deploy: section says where stages run).")]
KubeconfigOption = Annotated[Optional[Path], typer.Option(help="Kubeconfig file (default: in-cluster, "
                                                               "then $KUBECONFIG or ~/.kube/config).")]
ContextOption = Annotated[Optional[str], typer.Option(help="Kubeconfig context.")]


def _render(config_path: Path) -> tuple[RollartConfig, list[dict]]:
    from rich.console import Console

    from rollart.deploy import render_job
    from rollart.stages import prepare_config

    try:
        config = prepare_config(load_config(config_path))
        return config, render_job(config)
    except (ConfigError, ValueError) as exc:
        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@deploy_app.command("render")
def render_cmd(config_path: ConfigArg,
               out: Annotated[Path, typer.Option(help="Directory for the manifests (a Kustomize base).")] = Path("out/deploy"),
               ) -> None:
    """Write the job's Kubernetes manifests: Deployments, KEDA ScaledObjects, KafkaTopics, PodMonitor."""
    from rollart.cli import console
    from rollart.deploy import write_manifests

    config, docs = _render(config_path)
    files = write_manifests(docs, out)
    kinds: dict[str, int] = {}
    for doc in docs:
        kinds[doc["kind"]] = kinds.get(doc["kind"], 0) + 1
    console.print(f"job {config.job}: {len(docs)} objects in namespace {config.deploy.namespace} -> {out} "
                  f"({len(files)} files): " + ", ".join(f"{n} {k}" for k, n in kinds.items()))


@deploy_app.command("apply")
def apply_cmd(config_path: ConfigArg, kubeconfig: KubeconfigOption = None, context: ContextOption = None,
              dry_run: Annotated[bool, typer.Option(help="Server-side dry run: validate, change nothing.")] = False,
              ) -> None:
    """Render and server-side apply the job's objects (idempotent; field manager `rollart`)."""
    from rollart.cli import console
    from rollart.deploy.cluster import api_client, apply

    _, docs = _render(config_path)
    api = api_client(kubeconfig, context)
    applied = apply(api, docs, dry_run=dry_run)
    for item in applied:
        console.print(f"{'(dry run) ' if dry_run else ''}applied {item.kind}/{item.name}"
                      + (f" in {item.namespace}" if item.namespace else ""))
    console.print(f"{len(applied)} objects applied")


@deploy_app.command("status")
def status_cmd(config_path: ConfigArg, kubeconfig: KubeconfigOption = None, context: ContextOption = None,
               as_json: Annotated[bool, typer.Option("--json")] = False,
               lag: Annotated[bool, typer.Option(help="Read consumer-group lag from Kafka (kafka.bootstrap must "
                                                      "reach the cluster's brokers).")] = True) -> None:
    """Each consumer group's Deployment replicas (ready / desired), scaler bounds and lag."""
    import asyncio

    from rollart.cli import console, err_console
    from rollart.deploy import Renderer
    from rollart.deploy.cluster import api_client
    from rollart.deploy.status import deploy_status

    config, _ = _render(config_path)
    lag_rows = None
    if lag:
        from rollart.endpoints import resolve_endpoints
        from rollart.lag import consumer_lag

        try:
            lag_rows = asyncio.run(consumer_lag(config, resolve_endpoints(config)))
        except Exception as exc:  # status still shows replicas when Kafka is out of reach
            err_console.print(f"[yellow]lag unavailable: {exc}[/yellow]")
    rows = deploy_status(Renderer(config), api_client(kubeconfig, context), lag_rows)
    if as_json:
        print(json.dumps([row.as_dict() for row in rows]))
        return
    table = Table("stage", "deployment", "ready/desired", "autoscaling", "lag")
    for row in rows:
        desired = "-" if row.desired is None else str(row.desired)
        scaling = "-" if row.min_replicas is None else \
            f"{row.min_replicas}..{row.max_replicas}" + (" active" if row.scaler_active else "")
        lag_text = ", ".join(f"{g} {n}" for g, n in row.lag.items()) or "-"
        table.add_row(row.stage, row.deployment if row.exists else f"{row.deployment} (missing)",
                      f"{row.ready}/{desired}", scaling, lag_text)
    console.print(table)
