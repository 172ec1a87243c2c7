"""The data-parallel trainer (trainer.world_size > 1, gloo on CPU): N ranks take the same optimiser
step as one rank on the whole batch, a resumed world of another size continues a one-rank
checkpoint, and a rank that dies fails rank 0's next step at once (its supervisor then restarts the
trainer from its checkpoint: tests/job/test_run.py kills a rank of a live run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rollart.config import build_config
from rollart.stages.trainer import build_backend
from rollart.training.distributed import shard
from rollart.training.torch_backend import collate
from tests.conftest import REPO
from tests.training.test_torch_backend import _sample

ACTIONS = [("Right", 1.0), ("Left", 0.0), ("Up", 0.0), ("Right", 1.0), ("Down", 1.0), ("Left", 0.0),
           ("Right Right", 1.0)]  # 7 samples of unequal lengths: the ranks' shares are uneven


def test_shards_cover_a_batch_once_in_order():
    for rows in range(0, 12):
        for world in (1, 2, 3, 5):
            parts = [shard(rows, r, world) for r in range(world)]
            assert [i for p in parts for i in p] == list(range(rows))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def _config(tiny_model, world_size: int, **trainer) -> dict:
    return {"model": {"path": str(tiny_model)},
            "trainer": {"world_size": world_size, "micro_batch": 2, "lr": 5e-3, "torch_threads": 1,
                        "loss_aggregation": "token_mean", **trainer}}


def _batches(chat, tiny_model) -> list:
    backend = build_backend(build_config(_config(tiny_model, 1)))
    out = []
    for step in range(2):
        samples = [_sample(chat, f"s{step}-{i}", f"g{i % 2}", action, reward, backend)
                   for i, (action, reward) in enumerate(ACTIONS[step:] + ACTIONS[:step])]
        out.append(collate(samples, pad_id=chat.tokenizer.pad_token_id))
    return out


def _run_rank0(tmp_path, config: dict, batches, steps: int, **extra) -> dict:
    out = tmp_path / "rank0"
    out.mkdir(parents=True, exist_ok=True)
    torch.save(batches, tmp_path / "batches.pt")
    args = {"config": config, "batches": str(tmp_path / "batches.pt"), "steps": steps, "out": str(out), **extra}
    (tmp_path / "args.json").write_text(json.dumps(args))
    subprocess.run([sys.executable, str(REPO / "tests/training/dp_rank0.py"), str(tmp_path / "args.json")],
                   cwd=REPO, check=True, timeout=300)
    return {**json.loads((out / "result.json").read_text()), "state": out / "state.pt"}


def _assert_same(one_rank: dict, metrics: list[dict], state: dict, dp: dict) -> None:
    for single, parallel in zip(metrics, dp["metrics"]):
        for key in ("loss", "grad_norm", "entropy"):
            assert parallel[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key
    dp_state = torch.load(dp["state"], weights_only=True)
    assert dp_state.keys() == state.keys()
    # Summing the ranks' gradients reorders float additions (so does each rank's own prefix tree, over
    # its own rows), and Adam divides by the gradient's own size: a weight whose gradient is ~1e-8 moves
    # by its rounding. Weights agree to float noise: within 1% of one lr-sized (5e-3) update.
    for name, tensor in state.items():
        torch.testing.assert_close(dp_state[name], tensor, rtol=1e-4, atol=5e-5)
    assert dp["children_exit"] == [0] * len(dp["children_exit"]), "every rank stopped when told"


@pytest.mark.timeout(600)
def test_two_ranks_take_the_one_rank_step(tiny_model, chat, tmp_path):
    batches = _batches(chat, tiny_model)
    single = build_backend(build_config(_config(tiny_model, 1)))
    initial = {k: v.clone() for k, v in single.state_dict().items()}
    metrics = [single.train_step(b) for b in batches]
    moved = max(float((initial[k] - v).abs().max()) for k, v in single.state_dict().items())
    assert moved > 1e-3, "the steps moved the weights by far more than the tolerance"
    dp = _run_rank0(tmp_path, _config(tiny_model, 2), batches, steps=2)
    _assert_same(single, metrics, single.state_dict(), dp)


@pytest.mark.timeout(600)
def test_two_ranks_resume_a_one_rank_checkpoint(tiny_model, chat, tmp_path):
    """Only rank 0's state is checkpointed, and the ranks take it when they start: a checkpoint of one
    rank (model, Adam moments, step) continues on two as it would have on one."""
    batches = _batches(chat, tiny_model)
    single = build_backend(build_config(_config(tiny_model, 1)))
    first = single.train_step(batches[0])
    single.save(tmp_path / "ckpt")
    second = single.train_step(batches[1])
    dp = _run_rank0(tmp_path / "dp", _config(tiny_model, 2), [batches[1]], steps=1, resume=str(tmp_path / "ckpt"))
    _assert_same(single, [second], single.state_dict(), dp)
    assert first["loss"] != second["loss"]


@pytest.mark.timeout(600)
def test_a_killed_rank_fails_the_next_step_at_once(tiny_model, chat, tmp_path):
    batches = _batches(chat, tiny_model)
    dp = _run_rank0(tmp_path, _config(tiny_model, 2, dist_timeout_s=300), batches, steps=1, kill_rank=1)
    assert dp["after_kill"].startswith("RuntimeError"), dp["after_kill"]
    assert dp["failed_after_s"] < 60, "a dead rank is seen at once, not after trainer.dist_timeout_s"


def test_a_world_size_below_one_fails_naming_the_field():
    from rollart.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.world_size"):
        build_config({"trainer": {"world_size": 0}})
