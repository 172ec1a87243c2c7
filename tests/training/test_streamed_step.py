"""A step built from a batch's groups as they complete is the step the whole batch takes at once."""

from __future__ import annotations

import random
import pytest
import torch

from rollart.bench.trainer_step import shaped_batch
from rollart.training.algorithms import PolicyLossConfig
from rollart.training.buffer import Group
from rollart.training.streamed_step import StreamedStep
from rollart.training.torch_backend import TorchBackend, collate

GROUP = 4


def _groups() -> list[Group]:
    """Four groups of four with uneven lengths; the third all rewarded alike (no gradient of its own)."""
    rng = random.Random(3)
    lengths = [rng.randrange(12, 48) for _ in range(4 * GROUP)]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0, 0.0]
    samples = shaped_batch(lengths, [n // 3 for n in lengths], GROUP, 400, rng, rewards=rewards)
    groups: dict[str, Group] = {}
    for s in samples:
        groups.setdefault(s.trajectory.group_id, Group(s.trajectory.group_id)).members[s.trajectory.traj_id] = s
    return list(groups.values())


def _weights(backend) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in backend.model.parameters()])


@pytest.mark.parametrize("token_mean", [True, False])
async def test_groups_trained_as_they_complete_take_the_whole_batchs_step(tiny_model, token_mean):
    loss = PolicyLossConfig(algorithm="grpo", decoupled=True, token_mean=token_mean)
    groups = _groups()
    whole = TorchBackend(tiny_model, lr=1e-3, micro_batch=5, device="cpu", loss=loss)
    batch = collate([s for g in groups for s in g.members.values()], pad_id=0, norm="group_mean", version=1)
    expected = whole.train_step(batch)

    parts = TorchBackend(tiny_model, lr=1e-3, micro_batch=5, device="cpu", loss=loss)
    step = StreamedStep(parts, norm="group_mean", per_step=False, version=1, pad_id=0)
    for part in ([groups[2]], [groups[0], groups[3]], [groups[1]]):  # the order they completed in
        await step.add(part)
    metrics = await step.finish()

    assert [g.group_id for g in step.groups] == [groups[i].group_id for i in (2, 0, 3, 1)]
    assert len(step.samples) == 4 * GROUP
    # the same Adam step up to float summation order (its first step moves every weight by ~lr = 1e-3)
    assert torch.allclose(_weights(parts), _weights(whole), atol=2e-6), float((_weights(parts) - _weights(whole)).abs().max())
    # token means do not depend on how rows are cut into micro-batches; under sequence_mean a micro-batch's
    # token-mean metrics are weighed by its rows, so only the loss and the step are cut-invariant
    keys = ("loss", "grad_norm", "trained_fraction") + (("entropy", "ratio_mean", "clip_fraction") if token_mean else ())
    for key in keys:
        assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    assert metrics["ratio_max"] == pytest.approx(expected["ratio_max"], rel=1e-5)
    assert step.times.wall_s > 0 and step.times.cpu_s > 0, "the parts and the step are timed in their threads"


async def test_a_new_step_starts_from_zero_gradients(tiny_model):
    """Gradients left by an abandoned step (a stop while its batch filled) do not leak into the next."""
    loss = PolicyLossConfig(algorithm="grpo")
    groups = _groups()
    backend = TorchBackend(tiny_model, lr=1e-3, micro_batch=8, device="cpu", loss=loss)
    abandoned = StreamedStep(backend, norm="group", per_step=False, version=0, pad_id=0)
    await abandoned.add(groups[:2])
    step = StreamedStep(backend, norm="group", per_step=False, version=0, pad_id=0)
    await step.add(groups[:1])
    fresh = TorchBackend(tiny_model, lr=1e-3, micro_batch=8, device="cpu", loss=loss)
    alone = StreamedStep(fresh, norm="group", per_step=False, version=0, pad_id=0)
    await alone.add(groups[:1])
    for p, q in zip(backend.model.parameters(), fresh.model.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-7)
