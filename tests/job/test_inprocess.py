"""The in-process loop (the baseline of ``rollart bench time-to-quality``) on the session's vLLM engine:
its batches come from the feeder's task sequence and the weights it just trained, and the engine
holds those weights after each step. The engine gets its original weights back at the end."""

from __future__ import annotations

import torch

from rollart.config import build_config
from rollart.job.inprocess import InProcessLoop
from rollart.training.checkpoint import CheckpointStore
from rollart.training.torch_backend import TorchBackend
from rollart.weights.buckets import stage_state
from tests.stages.test_weight_sync import _logprob_gap


def _loop(job: str, engine, tiny_model, chat, tmp_path, *, lag: int = 0):
    """A small loop on the session's engine, its backend and the backend's initial weights (to restore)."""
    config = build_config({
        "job": job, "model": {"path": str(tiny_model)},
        "feeder": {"group_size": 4, "groups_per_batch": 2},
        "env": {"sampling": {"temperature": 1.0, "max_tokens": 2}},
        "trainer": {"micro_batch": 8, "lr": 1e-2},
        "tags": {"frozenlake": {"env": "frozenlake", "reward": {"type": "env"}}},
    })
    backend = TorchBackend(tiny_model, lr=1e-2, micro_batch=8)
    original = {k: v.clone() for k, v in backend.state_dict().items()}
    record = CheckpointStore(tmp_path / "checkpoints")
    loop = InProcessLoop(config, engine, backend, chat, chat.tokenizer.pad_token_id, record, tmp_path / "staging",
                         lag=lag)
    return loop, backend, original


async def test_in_process_loop_trains_fresh_batches_and_the_engine_follows(engine, tiny_model, chat, tmp_path):
    loop, backend, original = _loop("inproc", engine, tiny_model, chat, tmp_path)
    record = loop.record
    try:
        rows = await loop.run(2)
        assert [r["step"] for r in rows] == [1, 2]
        assert [r["trained_version"] for r in rows] == [0, 1], "each batch from the weights trained before it"
        assert all(r["samples"] == 8 and r["groups"] == 2 and r["staleness_max"] == 0 for r in rows)
        assert [r["step"] for r in record.read_record()] == [1, 2], "the trainer's record format"
        groups = {i.rsplit("-", 1)[0] for r in rows for i in r["traj_ids"]}
        assert groups == {f"inproc-g{n}" for n in range(4)}, "the feeder's task sequence, no group twice"
        assert all(r["sync_s"] > 0 and r["wait_s"] > 0 for r in rows)
        assert engine.version == 2
        assert any(not torch.equal(original[k], v) for k, v in backend.state_dict().items()), "it trained"
        gap, versions = await _logprob_gap(engine, backend, chat)
        assert set(versions) == {2} and gap < 2e-3, f"the engine serves the trained weights (gap {gap})"
        assert not (tmp_path / "staging" / "v1").exists(), "a loaded version's staging is removed"
    finally:
        await engine.load_weights(stage_state(original, tmp_path / "restore", bucket_bytes=32 << 20), 0)


async def test_a_lagged_loop_trains_every_batch_one_version_stale(engine, tiny_model, chat, tmp_path):
    """lag = 1: the engine serves the version before the trained one, as the pipeline does at alpha = 1,
    and the trainer's staleness (and the decoupled objective's proximal policy) see it."""
    loop, _, original = _loop("lagged", engine, tiny_model, chat, tmp_path, lag=1)
    try:
        rows = await loop.run(3)
        assert [r["trained_version"] for r in rows] == [0, 1, 2]
        assert [r["staleness_max"] for r in rows] == [0, 1, 1], "the first batch from v0, then one behind"
        assert engine.version == 2 and loop.version == 3, "the engine one version behind the trainer"
        assert (tmp_path / "staging" / "v3").exists() and not (tmp_path / "staging" / "v1").exists()
    finally:
        await engine.load_weights(stage_state(original, tmp_path / "restore", bucket_bytes=32 << 20), 0)


async def test_the_benchmarks_in_process_run_is_a_process_of_its_own_timed_from_its_launch(tiny_model, tmp_path):
    """``rollart bench time-to-quality`` runs the loop as a process (its imports inside its time, as a
    pipeline stage's are): the same config through a dump, its rows in its record."""
    from rollart.bench.time_to_quality import _in_process

    config = build_config({
        "job": "inprocess-launch", "model": {"path": str(tiny_model)},
        "generation": {"executor": "uni", "max_model_len": 1024},
        "feeder": {"group_size": 2, "groups_per_batch": 1},
        "env": {"sampling": {"temperature": 1.0, "max_tokens": 1}},
        "trainer": {"micro_batch": 2},
        "tags": {"frozenlake": {"env": "frozenlake", "reward": {"type": "env"}}},
    })
    rows, started_at = await _in_process(config, tmp_path, 1)
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == [1] and steps[0]["samples"] == 2
    assert steps[0]["time"] - started_at > 1.0, "the clock started before the process imported anything"
    assert "inprocess-launch" in (tmp_path / "config.json").read_text()
