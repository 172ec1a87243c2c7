"""The batch the Megatron scripts train on (megatron_compare.py, megatron_dp.py; imported as a sibling,
since they run as scripts): 8 trajectories of 20-27 tokens in two groups, 12 prompt tokens each."""

from dataclasses import replace

import torch


def eight_trajectories():
    from rollart.messages import Float32Array, Int32Array, ScoredTrajectory, UInt8Array
    from rollart.messages.samples import sample_trajectory
    from rollart.training.torch_backend import collate

    torch.manual_seed(0)
    samples = []
    for i in range(8):
        n = 20 + i
        t = sample_trajectory(f"g{i // 4}-t{i}", n_prompt=12, n_gen=n - 12)
        t = replace(t, group_id=f"g{i // 4}", token_ids=Int32Array(torch.randint(3, 400, (n,)).tolist()),
                    loss_mask=UInt8Array([0] * 12 + [1] * (n - 12)), logprobs=Float32Array([-1.0] * n),
                    versions=Int32Array([0] * n))
        samples.append(ScoredTrajectory(trajectory=t, reward=float(i % 4)))
    return collate(samples, pad_id=0)
