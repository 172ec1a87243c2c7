"""Kubernetes deployment of a job: render manifests, apply them server-side, show their status."""

from rollart.deploy.render import Renderer, k8s_name, read_manifests, render_job, write_manifests

__all__ = ["Renderer", "k8s_name", "read_manifests", "render_job", "write_manifests"]
