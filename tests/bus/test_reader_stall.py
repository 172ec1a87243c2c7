"""A read to the end that stops moving fails, naming where each partition stood, instead of polling for ever."""

from __future__ import annotations

import time

import pytest

from rollart.bus.backend import TopicPartition
from rollart.bus.reader import _Stall

A, B = TopicPartition("t", 0), TopicPartition("t", 1)


def test_positions_that_do_not_move_past_the_timeout_fail_naming_them():
    stall = _Stall(0.05, {A: 10, B: 7})
    stall.check({A: 3, B: 5})
    stall.check({A: 3, B: 5})  # not yet: within the timeout
    time.sleep(0.06)
    with pytest.raises(TimeoutError, match=r"t\[0\] at 3 of 10, t\[1\] at 5 of 7"):
        stall.check({A: 3, B: 5})


def test_any_progress_restarts_the_clock():
    stall = _Stall(0.05, {A: 10})
    for position in range(1, 6):
        time.sleep(0.02)
        stall.check({A: position})  # 0.1 s in all, but it moved every 0.02 s
    time.sleep(0.06)
    with pytest.raises(TimeoutError, match=r"t\[0\] at 5 of 10"):
        stall.check({A: 5})
