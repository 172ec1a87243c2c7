"""Checkpoints round-trip the trainer state; a resume cuts the record back to the checkpoint."""

from __future__ import annotations

import torch

from rollart.messages import ScoredTrajectory
from rollart.messages.samples import sample_trajectory
from rollart.training.checkpoint import CheckpointStore, TrainerState
from rollart.training.torch_backend import TorchBackend, collate, turn_samples


def test_checkpoint_round_trip_and_record_truncation(tmp_path, tiny_model):
    store = CheckpointStore(tmp_path / "ckpt", keep=2)
    backend = TorchBackend(tiny_model)
    for step in (1, 2, 3):
        store.append_record({"step": step, "traj_ids": [f"t{step}"]})
        backend.step = step
        store.save(backend, TrainerState(step=step, version=step, trained_ids=[f"t{step}"], offsets={"r:0": step}))
    store.append_record({"step": 4, "traj_ids": ["t4"]})  # trained, then a crash before its checkpoint
    assert sorted(p.name for p in store.root.glob("step-*")) == ["step-2", "step-3"], "only the last two kept"
    restored = TorchBackend(tiny_model)
    state = store.load(restored)
    assert state.step == 3 and state.version == 3 and state.offsets == {"r:0": 3} and restored.step == 3
    for a, b in zip(backend.model.parameters(), restored.model.parameters()):
        assert torch.equal(a, b)
    store.truncate_record(state.step)
    assert [r["step"] for r in store.read_record()] == [1, 2, 3]


def test_the_record_is_followed_a_complete_line_at_a_time_and_again_after_a_rewrite(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    follower = store.follow()
    assert follower.poll() == [], "no record yet"
    store.append_record({"step": 1})
    store.append_record({"step": 2})
    assert [r["step"] for r in follower.poll()] == [1, 2]
    assert follower.poll() == [], "each line is read once"
    with open(store.record_path, "a") as fh:  # the trainer mid-write
        fh.write('{"step": 3, "traj_')
    assert follower.poll() == [], "a line still being written waits"
    with open(store.record_path, "a") as fh:
        fh.write('ids": ["t3"]}\n')
    assert follower.poll() == [{"step": 3, "traj_ids": ["t3"]}]
    store.truncate_record(2)  # a resume rewrites the record
    store.append_record({"step": 3, "again": True})
    assert [r["step"] for r in follower.poll()] == [1, 2, 3]
    assert [r["step"] for r in follower.rows] == [1, 2, 3] and follower.rows[-1]["again"]


def test_per_step_samples_mask_one_turn_each():
    t = sample_trajectory(n_prompt=4, n_gen=4)
    from dataclasses import replace

    from rollart.messages import UInt8Array

    t = replace(t, loss_mask=UInt8Array([0, 0, 0, 0, 1, 1, 0, 1]))
    assert turn_samples(t) == [(6, [0, 0, 0, 0, 1, 1]), (8, [0, 0, 0, 0, 0, 0, 0, 1])]
    batch = collate([ScoredTrajectory(trajectory=t, reward=1.0)], pad_id=0, per_step=True, norm="none")
    assert batch.input_ids.shape == (2, 8)
    assert batch.loss_mask.sum(-1).tolist() == [2.0, 1.0]  # shifted: predicted tokens 4,5 then 7
    assert batch.advantages.tolist() == [1.0, 1.0]
