"""Options several commands share, declared once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from rollart.local.brokers import BROKER_ENV, BROKER_KINDS


def _use_broker(value: str | None) -> str | None:
    """Validate ``--broker`` and export it, so every stack the command (or its child processes) starts
    uses that broker."""
    if value is None:
        return None
    if value not in BROKER_KINDS:
        raise typer.BadParameter(f"choose one of {', '.join(BROKER_KINDS)}")
    os.environ[BROKER_ENV] = value
    return value


ConfigOption = Annotated[Optional[Path], typer.Option("--config", "-c",
                                                      help="Job config YAML (env ROLLART_* overrides).")]
BrokerOption = Annotated[Optional[str], typer.Option(
    "--broker", envvar=BROKER_ENV, callback=_use_broker,
    help="The broker of a local stack this command starts: kafka (Apache Kafka, the default where Java and "
         "its jars are installed) or tansu (in-memory, no Java). Unused where endpoints are configured.")]
