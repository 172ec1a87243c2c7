"""One small, valid instance of every message kind (doctor's round trip, benchmarks, tests)."""

from __future__ import annotations

from typing import Any

from rollart.messages.arrays import Float32Array, Int32Array, UInt8Array
from rollart.messages.kinds import (
    Abort,
    CompletedTrajectory,
    EvalSummary,
    EvalTagResult,
    GenerationRequest,
    GenerationResult,
    GroupEnded,
    SamplingParams,
    ScoredTrajectory,
    TaskSpec,
    VersionAnnouncement,
    WeightBucket,
    WeightManifest,
)


def sample_trajectory(traj_id: str = "g0-t0", n_prompt: int = 8, n_gen: int = 8, version: int = 3) -> CompletedTrajectory:
    n = n_prompt + n_gen
    return CompletedTrajectory(
        traj_id=traj_id, group_id=traj_id.split("-")[0], tag="frozenlake", env="frozenlake",
        token_ids=Int32Array(range(n)), loss_mask=UInt8Array([0] * n_prompt + [1] * n_gen),
        logprobs=Float32Array([0.0] * n_prompt + [-0.5] * n_gen),
        versions=Int32Array([-1] * n_prompt + [version] * n_gen),
        prompt_len=n_prompt, turns=2, env_reward=1.0, seed=7, start_version=version, end_version=version,
        metrics={"success": 1.0}, timings={"total": 0.25},
    )


def sample_messages(tokens: int = 16) -> list[Any]:
    """Every kind once; ``tokens`` sets the size of the token arrays."""
    trajectory = sample_trajectory(n_prompt=tokens // 2, n_gen=tokens - tokens // 2)
    return [
        TaskSpec(group_id="g0", env="frozenlake", tag="frozenlake", group_size=8, seed=7, redundancy=2),
        GenerationRequest(traj_id="g0-t0", turn=1, group_id="g0", tag="frozenlake", pool="default",
                          prompt_ids=Int32Array(range(tokens)), reply_partition=3, owner="env-0",
                          sampling=SamplingParams(temperature=1.0, max_tokens=32, stop_token_ids=(2,))),
        Abort(traj_id="g0-t1", turn=2, reason="env_step_timeout", group_id="g0", tag="frozenlake", replacement="g0-r0"),
        GroupEnded(group_id="g0", tag="frozenlake", completed=("g0-t0", "g0-r0"), aborted=1, replacements=1),
        GenerationResult(traj_id="g0-t0", turn=1, token_ids=Int32Array(range(tokens)),
                         logprobs=Float32Array([-0.25] * tokens), versions=Int32Array([3] * tokens),
                         finish_reason="stop", pool="default", instance="gen-0", prompt_tokens=tokens),
        trajectory,
        ScoredTrajectory(trajectory=trajectory, reward=1.0, reward_components={"env": 1.0}, scorer="rule"),
        VersionAnnouncement(job="doctor", version=3, step=3,
                            manifest=WeightManifest(transport="fs", location="/tmp/w",
                                                    buckets=(WeightBucket(key="b0", nbytes=1024, tensors=("w",)),),
                                                    total_bytes=1024, dtype="float32")),
        EvalSummary(job="doctor", version=4, step=4, tags={"frozenlake": EvalTagResult(
            tasks=8, scored=7, failed=1, success_rate=0.5, reward_mean=0.25, turns_mean=3.5)}),
    ]
