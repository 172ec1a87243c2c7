"""`rollart bench data-parallel`, small: both rows are timed and the two ways train the same losses."""

from __future__ import annotations

import asyncio

import pytest

from rollart.bench.data_parallel import bench_data_parallel
from rollart.config import build_config


@pytest.mark.timeout(300)
def test_the_ranks_train_the_one_rank_losses_and_both_are_timed(tmp_path):
    result = asyncio.run(bench_data_parallel(build_config({}), tmp_path, world_size=2, steps=2, samples=6,
                                             length=24, hidden=64, layers=1))
    one, two = result["rows"]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert one["step_s_mean"] > 0 and two["step_s_mean"] > 0
    assert result["speedup"] == pytest.approx(one["step_s_mean"] / two["step_s_mean"])
    assert result["loss_max_abs_diff"] < 1e-4, "N ranks take the one-rank step"
    with pytest.raises(ValueError, match="--world-size"):
        asyncio.run(bench_data_parallel(build_config({}), tmp_path, world_size=1))
