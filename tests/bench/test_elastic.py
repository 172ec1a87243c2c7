"""`rollart bench elastic`: its phases and per-phase rows (the live run is the benchmark's, not a test's:
tests/job/test_scale.py checks that scaling a live run loses and repeats nothing)."""

from __future__ import annotations

import pytest

from rollart.bench.elastic import parse_phases, phase_rows


def test_phases_parse_and_bad_ones_are_refused_naming_the_option():
    assert parse_phases("1x1,2x2,1x1") == [(1, 1), (2, 2), (1, 1)]
    assert parse_phases("3x1") == [(3, 1)]
    for bad in ("", "2", "0x1", "1x1,2", "axb", "1x2x3"):
        with pytest.raises(ValueError, match="--phases"):
            parse_phases(bad)


def test_rows_count_each_phases_trained_trajectories_after_it_settled():
    started, phase_s, settle_s = 1000.0, 100.0, 20.0
    record = [
        {"time": 1010.0, "traj_ids": ["a"] * 8},  # phase 1, still settling: not counted
        {"time": 1050.0, "traj_ids": ["b"] * 8},  # phase 1
        {"event": "publish", "time": 1060.0},  # not a step
        {"time": 1130.0, "traj_ids": ["c"] * 8}, {"time": 1190.0, "traj_ids": ["d"] * 8},  # phase 2
        {"time": 1300.0, "traj_ids": ["e"] * 8},  # after the last phase
    ]
    rows = phase_rows(record, [(1, 1), (2, 2)], started, phase_s, settle_s, pools=2)
    assert [r["trained"] for r in rows] == [8, 16]
    assert rows[0]["trajectories_per_min"] == pytest.approx(60 * 8 / 80, abs=0.05)
    assert rows[1]["per_member_per_min"] == pytest.approx(60 * 16 / 80 / (2 + 2 * 2), abs=0.05)
    assert [r["window_s"] for r in rows] == [80, 80]
