"""Every metric a dashboard queries is one the code really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import rollart.metrics  # noqa: F401 - registers the metrics
import rollart.rollout.routing  # noqa: F401
import rollart.stages.env  # noqa: F401
import rollart.stages.evaluation  # noqa: F401
import rollart.stages.feeder  # noqa: F401
import rollart.stages.generation  # noqa: F401
import rollart.stages.reward  # noqa: F401
import rollart.stages.trainer  # noqa: F401

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"


def exported_names() -> set[str]:
    names = set()
    for metric in REGISTRY.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(metric.type, ("",))
        names.update(metric.name + suffix for suffix in suffixes)
    return names


def test_dashboard_queries_use_exported_metrics():
    exported = exported_names()
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files
    for path in files:
        dashboard = json.loads(path.read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        assert exprs, f"{path.name} has no queries"
        for expr in exprs:
            for name in re.findall(r"rollart_[a-z_]+", expr):
                assert name in exported, f"{path.name}: {name} is not exported by rollart"
