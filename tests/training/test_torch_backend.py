"""The PyTorch backend on the tiny model: logprobs line up with the engine's, steps move the policy,
checkpoints round-trip."""

from __future__ import annotations

import torch

from rollart.messages import CompletedTrajectory, Float32Array, Int32Array, ScoredTrajectory, UInt8Array
from rollart.training.algorithms import PolicyLossConfig
from rollart.training.torch_backend import TorchBackend, collate, token_logprobs


def _sample(chat, traj: str, group: str, action: str, reward: float, backend) -> ScoredTrajectory:
    prompt = chat.initial("rules", "P _ _ _")
    generated = chat.tokenizer.encode(action, add_special_tokens=False)
    ids = prompt + generated
    with torch.no_grad():
        lp = token_logprobs(backend.model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
    logprobs = [0.0] * len(prompt) + lp[len(prompt) - 1:].tolist()
    t = CompletedTrajectory(traj_id=traj, group_id=group, tag="t", env="frozenlake", token_ids=Int32Array(ids),
                            loss_mask=UInt8Array([0] * len(prompt) + [1] * len(generated)),
                            logprobs=Float32Array(logprobs), versions=Int32Array([-1] * len(prompt) + [0] * len(generated)),
                            prompt_len=len(prompt), turns=1, env_reward=reward)
    return ScoredTrajectory(trajectory=t, reward=reward)


def test_grpo_steps_raise_the_rewarded_action_and_checkpoints_round_trip(tiny_model, chat, tmp_path):
    backend = TorchBackend(tiny_model, lr=5e-3, micro_batch=2, loss=PolicyLossConfig(algorithm="grpo"))
    samples = [_sample(chat, f"g-{i}", "g", action, reward, backend)
               for i, (action, reward) in enumerate([("Right", 1.0), ("Left", 0.0), ("Right", 1.0), ("Left", 0.0)])]
    batch = collate(samples, pad_id=chat.tokenizer.pad_token_id)
    assert batch.loss_mask.shape == (4, batch.input_ids.shape[1] - 1)
    assert torch.allclose(batch.advantages, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)

    def action_logprob(action: str) -> float:
        s = _sample(chat, "probe", "p", action, 0.0, backend)
        return float(sum(s.trajectory.logprobs))

    before = action_logprob("Right") - action_logprob("Left")
    first = backend.train_step(batch)
    assert abs(first["ratio_mean"] - 1.0) < 1e-3, "on-policy: trainer logprobs match the behaviour logprobs"
    for _ in range(4):
        backend.train_step(batch)
    after = action_logprob("Right") - action_logprob("Left")
    assert after > before + 0.5, (before, after)

    backend.save(tmp_path / "ckpt")
    restored = TorchBackend(tiny_model)
    restored.load(tmp_path / "ckpt")
    assert restored.step == 5
    for a, b in zip(backend.model.state_dict().values(), restored.model.state_dict().values()):
        assert torch.equal(a, b)


def _gradient(backend, batch, micro_batch: int) -> tuple[torch.Tensor, dict[str, float]]:
    backend.micro_batch = micro_batch
    backend.optimizer.zero_grad(set_to_none=True)
    metrics = backend.accumulate(batch, range(batch.input_ids.shape[0]))
    return torch.cat([p.grad.reshape(-1) for p in backend.model.parameters()]), metrics


def test_micro_batches_take_rows_by_length_cut_to_their_longest_and_keep_the_gradient(tiny_model):
    """Rows of very uneven lengths: micro-batches hold the shortest rows first, each only as wide as
    its longest row, and the accumulated gradient and metrics are those of the whole batch in one."""
    from rollart.bench.trainer_step import shaped_batch
    import random

    lengths = [90, 12, 40, 13, 88, 30, 11, 60]
    batch = collate(shaped_batch(lengths, [n // 3 for n in lengths], 4, 400, random.Random(0)), pad_id=0,
                    norm="group")
    micro = batch.micro_batches(range(8), 3)
    assert [m.input_ids.shape for m in micro] == [(3, 13), (3, 60), (2, 90)]
    assert [m.loss_mask.shape[1] for m in micro] == [12, 59, 89]
    assert sorted(sum([m.group_ids for m in micro], [])) == sorted(batch.group_ids)
    assert [int(m.attention_mask.sum()) for m in micro] == [11 + 12 + 13, 30 + 40 + 60, 88 + 90]
    backend = TorchBackend(tiny_model, lr=1e-3, loss=PolicyLossConfig(algorithm="grpo"), device="cpu")
    whole, whole_metrics = _gradient(backend, batch, 8)
    parts, parts_metrics = _gradient(backend, batch, 3)
    assert torch.allclose(whole, parts, atol=1e-6, rtol=1e-4), float((whole - parts).abs().max())
    for key, value in whole_metrics.items():
        assert abs(value - parts_metrics[key]) < 1e-5, key
    shard = batch.micro_batches(range(4, 8), 2)  # a data-parallel rank's rows: its own, sorted
    assert [m.input_ids.shape for m in shard] == [(2, 30), (2, 88)]


def test_logprobs_only_where_trained_equal_the_full_ones_there_and_so_do_their_gradients(tiny_model):
    """``where``: the output layer runs only at the loss mask's positions; there the logprobs, the
    entropy and the gradient they give are those of the full computation, elsewhere the values are 0."""
    from rollart.bench.trainer_step import shaped_batch
    import random

    lengths = [50, 23, 37]
    batch = collate(shaped_batch(lengths, [3, 5, 2], 3, 400, random.Random(1)), pad_id=0)
    backend = TorchBackend(tiny_model, device="cpu")
    mask = batch.loss_mask.bool()
    results = []
    for where in (None, batch.loss_mask):
        backend.model.zero_grad(set_to_none=True)
        picked, entropy = token_logprobs(backend.model, batch.input_ids, batch.attention_mask, with_entropy=True,
                                         where=where)
        (picked[mask].sum() + entropy[mask].sum()).backward()
        results.append((picked, entropy, torch.cat([p.grad.reshape(-1) for p in backend.model.parameters()])))
    (full, full_entropy, full_grad), (part, part_entropy, part_grad) = results
    assert int(mask.sum()) == 10 and torch.allclose(full[mask], part[mask], atol=1e-5)
    assert torch.allclose(full_entropy[mask], part_entropy[mask], atol=1e-5)
    assert not part[~mask].any() and not part_entropy[~mask].any()
    assert torch.allclose(full_grad, part_grad, atol=1e-5, rtol=1e-4), float((full_grad - part_grad).abs().max())
