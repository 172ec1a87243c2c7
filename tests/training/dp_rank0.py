"""Rank 0 of a data-parallel trainer in its own process (torch.distributed is per process, and the
test session's may already hold a one-process group): ``python tests/training/dp_rank0.py ARGS.json``.

ARGS: ``config`` (a job config), ``batches`` (a torch file of batches), ``steps``, ``out`` (where the
state dict and metrics go), ``resume`` (a checkpoint directory to start from, or null), ``kill_rank``
(SIGKILL that child rank after the first step, then try another step: its error goes to ``out``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from rollart.config import build_config
from rollart.stages.trainer import build_backend
from rollart.training import distributed
from rollart.training.ranks import Rendezvous


def main() -> None:
    args = json.loads(Path(sys.argv[1]).read_text())
    config = build_config(args["config"])
    batches = torch.load(args["batches"], weights_only=False)
    rdzv = Rendezvous.local(config.trainer.world_size)
    children = distributed.start_local_ranks(config, rdzv, Path(args["out"]) / "ranks")
    backend = distributed.data_parallel(config, rdzv, children, build_backend)
    if args.get("resume"):
        backend.load(args["resume"])
    metrics = [backend.train_step(batches[i]) for i in range(args["steps"])]
    result: dict = {"metrics": metrics, "children": [c.pid for c in children]}
    if args.get("kill_rank"):
        os.kill(children[args["kill_rank"] - 1].pid, signal.SIGKILL)
        started = time.monotonic()
        try:
            backend.train_step(batches[0])
            result["after_kill"] = "trained"
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["after_kill"] = f"{type(exc).__name__}: {exc}"
        result["failed_after_s"] = time.monotonic() - started
    else:
        torch.save(backend.state_dict(), Path(args["out"]) / "state.pt")
    backend.close()
    result["children_exit"] = [c.returncode for c in children]
    (Path(args["out"]) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
