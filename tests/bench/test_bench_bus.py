"""`rollart bench bus --json` runs end to end and prints the four figures (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

KEYS = {"produce_msgs_per_s", "consume_msgs_per_s", "roundtrip_p50_s", "roundtrip_p99_s"}


def test_bench_bus_json(stack, tmp_path):
    env = {**os.environ, "ROLLART_KAFKA_BOOTSTRAP": stack.kafka_bootstrap, "ROLLART_REDIS_URL": stack.redis_url,
           "ROLLART_JOB": "benchtest"}
    out = tmp_path / "bus.json"
    result = subprocess.run([sys.executable, "-m", "rollart.cli", "bench", "bus", "--json", "--messages", "500",
                             "--roundtrips", "20", "--fill", "300", "--fill-steps", "2", "--out", str(out)],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert KEYS <= set(figures)
    assert figures["produce_msgs_per_s"] > 0 and figures["consume_msgs_per_s"] > 0
    assert 0 < figures["roundtrip_p50_s"] <= figures["roundtrip_p99_s"]
    assert json.loads(out.read_text()) == figures
    assert [row["records_per_partition"] for row in figures["growth"]] == [300, 600]
    assert all(0 < row["roundtrip_p50_s"] <= row["roundtrip_p99_s"] for row in figures["growth"])
