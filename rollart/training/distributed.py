"""Data-parallel training: the trainer stage as ``trainer.world_size`` ranks of torch.distributed.

Rank 0 *is* the trainer stage: it consumes ``rewards.results``, buffers, checkpoints, publishes and
commits, exactly as a one-rank trainer does. Every rank holds a replica of the model and optimizer.
For each batch rank 0 broadcasts the batch; each rank runs forward and backward on its contiguous
share of the rows, weighing every micro-batch by its share of the *whole* batch's tokens; the
gradients (and metrics) are summed across ranks, so every rank holds the one-rank gradient, clips it
the same way and takes the same optimizer step. The replicas stay identical without exchanging
weights. Rank 0 sends its whole state (model and optimizer) when the ranks start, so a checkpoint is
a one-rank checkpoint: only rank 0 writes it, and a run may resume at another world size.

One thread of rank 0 owns the process group (:class:`RankChannel`): collectives must be issued in
the same order on every rank, and while rank 0 waits for a batch (minutes, on a slow rollout) that
thread sends a heartbeat, so the other ranks' wait never reaches ``trainer.dist_timeout_s``. A rank
that dies fails the next collective on the others (its connections close, or the timeout passes):
rank 0 then exits non-zero and its supervisor (`rollart run`, torchrun, Kubernetes) restarts the
trainer from its checkpoint; the samples of the failed step were never committed, so they come again.

Launch: under torchrun or a Kubernetes rendering the environment names each process's rank
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: torch.distributed's ``env://``). Without
``RANK``, `rollart consume trainer` is the launcher: it runs rank 0 and starts the other ranks as its
own child processes on this machine (``python -m rollart.training.distributed``).
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from rollart.training.algorithms import combine_metrics, over_trained_rows
from rollart.training.ranks import Rendezvous
from rollart.training.torch_backend import Batch, zero_missing_gradients

log = logging.getLogger(__name__)


def init_group(rdzv: Rendezvous, *, backend: str, timeout_s: float) -> None:
    """Join the trainer's process group (rank 0 hosts the rendezvous store)."""
    store = dist.TCPStore(rdzv.addr, rdzv.port, rdzv.world_size, is_master=rdzv.rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rdzv.rank, world_size=rdzv.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    log.info("trainer rank %d of %d joined (%s, %s:%d)", rdzv.rank, rdzv.world_size, backend, rdzv.addr, rdzv.port)


def group_backend(config) -> str:
    """NCCL for ranks on GPUs, gloo on CPUs (the trainer's device: configured, else cuda when there is one)."""
    device = config.trainer.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device.startswith("cuda") else "gloo"


def bind_local_device(rdzv: Rendezvous) -> None:
    """On a GPU machine each local rank trains on its own device (torchrun's LOCAL_RANK, else the rank)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rdzv.rank)) % torch.cuda.device_count())


def shard(rows: int, rank: int, world_size: int) -> range:
    """This rank's contiguous rows of a batch of ``rows`` (the first ranks take one more when uneven)."""
    base, extra = divmod(rows, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


# -- one step on every rank ------------------------------------------------------------------------


def _sum_gradients(model: torch.nn.Module) -> None:
    """All-reduce (sum) every parameter's gradient in one flat buffer (a rank with no rows adds zeros)."""
    params = zero_missing_gradients(model)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n


def _sum_metrics(metrics: dict[str, float], world_size: int) -> dict[str, float]:
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, metrics)
    total: dict[str, float] = {}
    for part in gathered:
        combine_metrics(total, part)
    return total


def shard_step(backend, batch: Batch, rank: int, world_size: int) -> dict[str, float]:
    """This rank's part of one optimiser step: the rank's rows, gradients summed over ranks, the step."""
    backend.optimizer.zero_grad(set_to_none=True)
    metrics = backend.accumulate(batch, shard(batch.input_ids.shape[0], rank, world_size))
    _sum_gradients(backend.model)
    metrics = over_trained_rows(_sum_metrics(metrics, world_size))
    metrics["grad_norm"] = backend.apply_gradients()
    return metrics


def _broadcast_state(backend, rank: int) -> None:
    """Every rank takes rank 0's model and optimizer state (at start: initial or resumed weights)."""
    for tensor in [*backend.model.parameters(), *backend.model.buffers()]:
        dist.broadcast(tensor.data, src=0)
    box: list[Any] = [{"optimizer": backend.optimizer.state_dict(), "step": backend.step} if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if rank != 0:
        backend.optimizer.load_state_dict(box[0]["optimizer"])
        backend.step = box[0]["step"]


def _command(message: tuple | None = None) -> tuple:
    """Rank 0 sends ``message``; the others receive it (the order of work every rank follows)."""
    box: list[Any] = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -- rank 0 ------------------------------------------------------------------------------------------


class RankChannel:
    """Rank 0's one thread for collectives: commands run there in order, a heartbeat when idle."""

    def __init__(self, heartbeat_s: float):
        self.heartbeat_s = heartbeat_s
        self._work: queue.Queue[tuple[tuple, Callable[[], Any], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="trainer-ranks", daemon=True)
        self._thread.start()

    def call(self, command: tuple, run: Callable[[], Any]) -> Any:
        """Send ``command`` to the other ranks, then run ``run()`` here; its result (or error)."""
        done: Future = Future()
        self._work.put((command, run, done))
        return done.result()

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=30)

    def _serve(self) -> None:
        failed: BaseException | None = None  # once the group broke, every later call fails the same way
        while True:
            try:
                item = self._work.get(timeout=self.heartbeat_s)
            except queue.Empty:
                failed = failed or self._send(("ping",))
                continue
            if item is None:
                if failed is None:
                    self._send(("stop",))
                return
            command, run, done = item
            failed = failed or self._send(command)
            if failed is not None:
                done.set_exception(failed)
                continue
            try:
                done.set_result(run())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                failed = exc
                done.set_exception(exc)

    @staticmethod
    def _send(command: tuple) -> BaseException | None:
        """Send a command; the error if the ranks are gone."""
        try:
            _command(command)
        except BaseException as exc:  # noqa: BLE001 - the caller decides what fails
            log.error("the trainer's ranks are gone (%s): the next step fails", exc)
            return exc
        return None


class DataParallelBackend:
    """Rank 0's backend: what the trainer stage calls, each step run on every rank."""

    def __init__(self, backend, rdzv: Rendezvous, *, heartbeat_s: float, children: list[subprocess.Popen]):
        self.backend = backend
        self.rdzv = rdzv
        self.children = children  # the ranks this process started (none under torchrun / Kubernetes)
        self.channel = RankChannel(heartbeat_s)
        self.channel.call(("sync",), lambda: _broadcast_state(backend, 0))

    @property
    def step(self) -> int:
        return self.backend.step

    def train_step(self, batch: Batch) -> dict[str, float]:
        _check_children(self.children)
        return self.channel.call(("train", batch),
                                 lambda: shard_step(self.backend, batch, 0, self.rdzv.world_size))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.backend.state_dict()

    def save(self, directory: str | Path) -> None:
        self.backend.save(directory)

    def load(self, directory: str | Path) -> None:
        """Resume: load here, then every rank takes this state."""
        self.backend.load(directory)
        self.channel.call(("sync",), lambda: _broadcast_state(self.backend, 0))

    def close(self) -> None:
        self.channel.close()
        for child in self.children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_children(children: list[subprocess.Popen]) -> None:
    dead = [(i + 1, c.returncode) for i, c in enumerate(children) if c.poll() is not None]
    if dead:
        raise RuntimeError(f"trainer rank {dead[0][0]} exited ({dead[0][1]}): restart the trainer")


def start_local_ranks(config, rdzv: Rendezvous, workdir: Path) -> list[subprocess.Popen]:
    """Ranks 1..N-1 as child processes of this one (the launcher), with this config; they die with
    it (call from a thread that lives as long as the process: the kernel's signal follows the thread)."""
    from rollart.local.children import die_with_parent

    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "rank-config.json"
    path.write_text(config.model_dump_json())
    children = []
    for rank in range(1, rdzv.world_size):
        env = {**os.environ, **rdzv.env(rank)}
        children.append(subprocess.Popen([sys.executable, "-m", "rollart.training.distributed", str(path)], env=env,
                                         stdin=subprocess.DEVNULL, preexec_fn=die_with_parent))
    return children


def join(config, rdzv: Rendezvous, children: list[subprocess.Popen] | None = None) -> None:
    """Join the trainer's process group, before any rank builds its backend (Megatron makes its
    parallel state from this group). Rank 0 watches the children it started meanwhile: one that
    fails to start fails this one now, not at the timeout."""
    t = config.trainer
    joining = threading.Thread(target=init_group, args=(rdzv,), daemon=True,
                               kwargs={"backend": group_backend(config), "timeout_s": t.dist_timeout_s})
    joining.start()
    while joining.is_alive():
        joining.join(0.5)
        _check_children(children or [])
    if not dist.is_initialized():
        raise RuntimeError(f"the trainer's {rdzv.world_size} ranks did not join within {t.dist_timeout_s:g}s")


def data_parallel(config, rdzv: Rendezvous, children: list[subprocess.Popen], build) -> DataParallelBackend:
    """Rank 0: join the group (the other ranks are started or starting), build the backend with
    ``build(config)`` and hand the other ranks its weights."""
    join(config, rdzv, children)
    return DataParallelBackend(build(config), rdzv, heartbeat_s=config.trainer.dist_timeout_s / 4, children=children)


# -- ranks 1..N-1 ------------------------------------------------------------------------------------


def serve_rank(backend, rdzv: Rendezvous) -> int:
    """Follow rank 0's commands until it says stop; returns the steps taken. A failed collective
    (rank 0 gone) raises: the process exits non-zero and its supervisor restarts it."""
    steps = 0
    while True:
        command = _command()
        kind = command[0]
        if kind == "train":
            shard_step(backend, command[1], rdzv.rank, rdzv.world_size)
            steps += 1
        elif kind == "sync":
            _broadcast_state(backend, rdzv.rank)
        elif kind == "stop":
            return steps
        # "ping": rank 0 is waiting for a batch


def run_rank(config, rdzv: Rendezvous) -> None:
    """A rank other than 0: join, build the same backend, serve until rank 0 says stop (or goes away,
    which ends this rank too)."""
    from rollart.stages.trainer import build_backend

    bind_local_device(rdzv)
    join(config, rdzv)
    backend = build_backend(config)
    try:
        steps = serve_rank(backend, rdzv)
        log.info("trainer rank %d stopped after %d steps", rdzv.rank, steps)
    finally:
        dist.destroy_process_group()


def exit_stopped_rank() -> NoReturn:
    """A rank above 0 that rank 0 stopped cleanly exits 0 now, past the interpreter's teardown:
    there gloo's C++ threads, still alive, can abort the process ("terminate called without an
    active exception", pytorch#179291), and its supervisor would count a finished rank as failed."""
    from rollart.bus.stopping import exit_without_teardown

    exit_without_teardown(0)


def main() -> None:
    """A child rank started by :func:`start_local_ranks`. SIGTERM (its process group's stop) does not
    end it: rank 0 finishes its step, then sends stop."""
    import signal

    from rollart.config import RollartConfig

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = RollartConfig.model_validate_json(Path(sys.argv[1]).read_text())
    rdzv = Rendezvous.from_env(config.trainer.world_size)
    assert rdzv is not None, "a child rank is started with RANK set"
    run_rank(config, rdzv)
    exit_stopped_rank()


if __name__ == "__main__":
    main()
