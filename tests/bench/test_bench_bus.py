"""`rollart bench bus --json` runs end to end and prints the four figures (no timing assertions):
on the configured stack, and with `--broker both` on a throw-away Apache Kafka and Tansu, side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

KEYS = {"produce_msgs_per_s", "consume_msgs_per_s", "roundtrip_p50_s", "roundtrip_p99_s"}
SMALL = ["--messages", "500", "--roundtrips", "20", "--fill", "300", "--fill-steps", "2"]


def bench_bus(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollart.cli", "bench", "bus", "--json", *SMALL, *args],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def check(figures: dict) -> None:
    assert KEYS <= set(figures)
    assert figures["produce_msgs_per_s"] > 0 and figures["consume_msgs_per_s"] > 0
    assert 0 < figures["roundtrip_p50_s"] <= figures["roundtrip_p99_s"]
    assert [row["records_per_partition"] for row in figures["growth"]] == [300, 600]
    assert all(0 < row["roundtrip_p50_s"] <= row["roundtrip_p99_s"] for row in figures["growth"])


def test_bench_bus_json(stack, tmp_path):
    env = {**os.environ, "ROLLART_KAFKA_BOOTSTRAP": stack.kafka_bootstrap, "ROLLART_REDIS_URL": stack.redis_url,
           "ROLLART_JOB": "benchtest"}
    out = tmp_path / "bus.json"
    result = bench_bus(env, "--out", str(out))
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    check(figures)
    assert json.loads(out.read_text()) == figures


def test_bench_bus_on_both_brokers_side_by_side(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ROLLART_")},
           "ROLLART_HOME": str(tmp_path / "home"), "ROLLART_JOB": "benchboth"}
    result = bench_bus(env, "--broker", "both")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert set(figures["brokers"]) == {"kafka", "tansu"}
    for kind, measured in figures["brokers"].items():
        assert measured["broker"] == kind
        check(measured)
    assert figures["broker"] == "kafka" and figures["roundtrip_p50_s"] == figures["brokers"]["kafka"]["roundtrip_p50_s"]
