"""The CPU plan of a run on one machine: ``machine.scheduling`` names stages (and ``stack``, the local
stack's services), and a typo fails at start-up."""

from __future__ import annotations

import pytest

from rollart.config import ConfigError, StageScheduling, build_config
from rollart.local.supervision import stage_scheduling


def test_machine_scheduling_names_registered_stages_and_a_typo_fails_naming_it():
    plan = stage_scheduling(build_config({"machine": {"scheduling": {"env": {"nice": 5, "policy": "batch"},
                                                                     "stack": {"nice": 10}}}}))
    assert plan == {"env": StageScheduling(nice=5, policy="batch"), "stack": StageScheduling(nice=10)}
    with pytest.raises(ConfigError, match=r"machine\.scheduling: gen is not a stage; the stages are generation, env"):
        stage_scheduling(build_config({"machine": {"scheduling": {"gen": {"nice": 5}}}}))


@pytest.mark.parametrize("stage, field", [({"nice": 20}, "nice"), ({"nice": -21}, "nice"),
                                          ({"policy": "fifo"}, "policy"), ({"share": 2}, "share"),
                                          ({"slice_ms": 0.01}, "slice_ms"), ({"slice_ms": 500}, "slice_ms")])
def test_a_bad_stage_scheduling_names_the_field(stage, field):
    with pytest.raises(ConfigError, match=rf"machine\.scheduling\.env\.{field}: "):
        build_config({"machine": {"scheduling": {"env": stage}}})


def test_a_slice_under_the_idle_policy_fails_naming_both():
    with pytest.raises(ConfigError, match=r"machine\.scheduling\.env: .*slice_ms is set but policy is idle"):
        build_config({"machine": {"scheduling": {"env": {"policy": "idle", "slice_ms": 5}}}})
