"""Experiment tracking: every training step's figures to TensorBoard, Weights & Biases and MLflow.

``tracking:`` in the job config turns each on (any of them, or none):

    tracking:
      tensorboard: {dir: out/tb}                                  # event files, one folder per run
      wandb: {project: rollart, mode: offline, dir: out/wandb}    # online needs WANDB_API_KEY
      mlflow: {tracking_uri: "sqlite:///out/mlflow.db", experiment: rollart}   # or http://mlflow:5000

The trainer logs one point per step (the step number is the x axis): reward, success, staleness,
tokens, turns, wait and train seconds, the loss terms of its backend (``loss/...``) and the buffer's
drops (``dropped/...``); the run's config goes with it (W&B config, MLflow params, a TensorBoard
text). The run is named after the job (``tracking.run_name`` overrides), so a resumed trainer
continues the same run: W&B resumes the id, MLflow finds the run by its ``rollart.job`` tag, and
TensorBoard appends to the same folder. The eval stage logs each evaluated version's figures
(``eval/<tag>/success_rate``, ...; the step is the training step of the version) to a run of its own,
``<run>-eval``. The libraries are optional (``pip install 'rollart[tracking]'``); one that is configured
but not installed fails the trainer at start-up naming the field.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from rollart.config import ConfigError, RollartConfig

log = logging.getLogger(__name__)

SCALARS = ("reward_mean", "success_rate", "staleness_max", "staleness_mean", "token_staleness_mean", "samples",
           "groups", "tokens", "turns_mean", "wait_s", "train_s", "buffer_groups", "partial_groups", "trained_version")


def step_scalars(row: dict) -> dict[str, float]:
    """The numbers of one record row (``rollart.stages.trainer.step_record``), flat, for a tracker."""
    out = {name: float(row[name]) for name in SCALARS if isinstance(row.get(name), (int, float))}
    out.update({f"loss/{k}": float(v) for k, v in (row.get("metrics") or {}).items()})
    out.update({f"dropped/{k}": float(v) for k, v in (row.get("dropped") or {}).items()})
    return out


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _need(module: str, field: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{field}: {module.split('.')[0]} is not installed (pip install 'rollart[tracking]')") \
            from None


class TensorBoard:
    def __init__(self, directory, run_name: str, config: dict):
        _need("tensorboard", "tracking.tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory / run_name))
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=1)}\n```")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():  # eval/... figures keep their own section
            self.writer.add_scalar(name if name.startswith("eval/") else f"train/{name}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, spec, run_name: str, config: dict, group: str):
        wandb = _need("wandb", "tracking.wandb")
        settings = wandb.Settings(silent=True, console="off")
        self.run = wandb.init(project=spec.project, entity=spec.entity, name=run_name, id=run_name, group=group,
                              resume="allow", mode=spec.mode, dir=str(spec.dir) if spec.dir else None,
                              config=config, settings=settings)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    def __init__(self, spec, run_name: str, config: dict):
        mlflow = _need("mlflow", "tracking.mlflow")
        self.client = mlflow.MlflowClient(tracking_uri=spec.tracking_uri)
        experiment = self.client.get_experiment_by_name(spec.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(spec.experiment)
        same = self.client.search_runs([experiment_id], filter_string=f"tags.`rollart.job` = '{run_name}'",
                                       max_results=1)
        if same:  # a resumed trainer: the same run
            self.run_id = same[0].info.run_id
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name,
                                                 tags={"rollart.job": run_name}).info.run_id
            flat = _flatten(config)
            for key in sorted(flat)[:500]:  # MLflow caps params per run and value length
                self.client.log_param(self.run_id, key, str(flat[key])[:500])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(name.replace("/", "."), value, now, step)
                                                    for name, value in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: data}


class Trackers:
    """Every configured tracker; a tracker that fails mid-run is logged and dropped, never fatal to training."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    @classmethod
    def from_config(cls, config: RollartConfig, role: str = "") -> "Trackers":
        """The trainer's trackers (``role`` ""), or another stage's (the eval stage: ``eval``), which log
        to a run of their own, ``<run>-<role>`` (one writer per run; W&B groups them under ``<run>``)."""
        spec = config.tracking
        group = spec.run_name or config.job
        run_name = f"{group}-{role}" if role else group
        dump = config.model_dump(mode="json")  # secrets are masked in json mode
        trackers: list[Tracker] = []
        if spec.tensorboard is not None:
            trackers.append(TensorBoard(spec.tensorboard.dir, run_name, dump))
        if spec.wandb is not None:
            trackers.append(Wandb(spec.wandb, run_name, dump, group))
        if spec.mlflow is not None:
            trackers.append(Mlflow(spec.mlflow, run_name, dump))
        return cls(trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log(self, step: int, row: dict) -> None:
        """One record row of the trainer (``step_record``)."""
        self.log_scalars(step, step_scalars(row))

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(step, scalars)
            except Exception:  # noqa: BLE001 - a tracking service down must not stop training
                log.exception("%s failed: no more tracking to it this run", type(tracker).__name__)
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:  # noqa: BLE001
                log.exception("closing %s failed", type(tracker).__name__)
