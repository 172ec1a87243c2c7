"""Histograms read from the stages' own /metrics endpoints, for figures over time in a long run.

``rollart soak`` reads the env members' per-turn bus overhead
(``rollart_env_generation_overhead_seconds``) this way every sample, so its report can say whether a
turn costs the same in the last minutes as in the first: cumulative buckets are scraped, and each
window's quantiles come from the buckets' increase over that window (Prometheus' ``increase`` then
``histogram_quantile``). A restarted member starts its counters from zero: a drop is a reset.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile over cumulative ``(le, count)`` buckets (linear within a bucket);
    NaN when they hold nothing."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    rank, previous_le, previous_count = q * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return previous_le
            return previous_le + (le - previous_le) * (rank - previous_count) / max(count - previous_count, 1e-12)
        previous_le, previous_count = le, count
    return buckets[-2][0]


@dataclass(frozen=True)
class HistogramSample:
    """One scrape of a histogram, summed over its label sets: ``buckets`` maps le to a cumulative count."""

    at: float
    count: float
    total: float
    buckets: dict[float, float]

    def increase_since(self, earlier: "HistogramSample | None") -> "HistogramSample":
        """What was observed between ``earlier`` and this scrape (all of it after a counter reset)."""
        if earlier is None or self.count < earlier.count:
            return self
        return HistogramSample(self.at, self.count - earlier.count, self.total - earlier.total,
                               {le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()})


def parse_histogram(text: str, name: str, at: float) -> HistogramSample | None:
    """The histogram ``name`` in a /metrics text, summed over its label sets (None if absent)."""
    count = total = 0.0
    buckets: dict[float, float] = {}
    found = False
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        found = True
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
            elif sample.name == f"{name}_sum":
                total += sample.value
    return HistogramSample(at, count, total, buckets) if found else None


def stage_targets(targets_file: Path, stage: str) -> dict[str, str]:
    """instance -> host:port of one stage's members, from the run's Prometheus file_sd targets."""
    try:
        entries = json.loads(targets_file.read_text())
    except (OSError, ValueError):
        return {}
    return {e["labels"]["instance"]: e["targets"][0] for e in entries if e["labels"].get("stage") == stage}


def scrape(target: str, timeout_s: float = 2.0) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=timeout_s) as response:
            return response.read().decode()
    except OSError:
        return None  # restarting, or not serving yet


def windows(series: dict[str, list[HistogramSample]], started: float, window_s: float,
            quantiles: tuple[float, ...] = (0.5, 0.99)) -> list[dict[str, float]]:
    """Per window: observations, mean and quantiles of what every instance observed in it."""
    increases: list[HistogramSample] = []
    for samples in series.values():
        previous = None
        for sample in samples:
            increases.append(sample.increase_since(previous))
            previous = sample
    if not increases:
        return []
    rows, at, end = [], started, max(s.at for s in increases)
    while at < end:
        inside = [s for s in increases if at < s.at <= at + window_s]
        count = sum(s.count for s in inside)
        merged: dict[float, float] = {}
        for s in inside:
            for le, n in s.buckets.items():
                merged[le] = merged.get(le, 0.0) + n
        row = {"from_s": round(at - started), "observations": int(count),
               "mean_s": round(sum(s.total for s in inside) / count, 6) if count else None}
        for q in quantiles:
            value = bucket_quantile(list(merged.items()), q) if count else float("nan")
            row[f"p{round(q * 100):d}_s"] = None if math.isnan(value) else round(value, 6)
        rows.append(row)
        at += window_s
    return rows
