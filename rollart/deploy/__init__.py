"""Kubernetes deployment of a job: render manifests, apply them server-side, show their status.

The names below load on first use: rollart.config imports :mod:`rollart.deploy.settings`, and the
renderer imports the config and the stages.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollart.deploy.render import Renderer, k8s_name, read_manifests, render_job, write_manifests

__all__ = ["Renderer", "k8s_name", "read_manifests", "render_job", "write_manifests"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module("rollart.deploy.render"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
