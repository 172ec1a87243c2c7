"""One rank of a 2-rank data-parallel Megatron trainer on CPU, launched torchrun-style (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment): ``python megatron_dp.py MODEL``.

Both ranks join the trainer's process group first and Megatron's parallel state is made over it
(data-parallel size 2); rank 0 drives the step, rank 1 serves it (rollart.training.distributed.run_rank).
Rank 0 then takes the PyTorch backend's one-rank step on the same batch and prints one JSON line:
the two losses and the largest weight gap after the step. The two CPU shims of megatron_compare.py.
"""

import contextlib
import json
import sys

import torch

torch.cuda.current_device = lambda: "cpu"


def main(model_dir: str) -> None:
    from megatron.core import tensor_parallel
    from megatron_batch import eight_trajectories

    from rollart.config import build_config
    from rollart.stages.trainer import build_backend, loss_config
    from rollart.training import distributed
    from rollart.training.ranks import Rendezvous
    from rollart.training.torch_backend import TorchBackend

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    config = build_config({"model": {"path": model_dir}, "trainer": {
        "backend": "megatron", "device": "cpu", "world_size": 2, "micro_batch": 4, "lr": 1e-3}})
    rdzv = Rendezvous.from_env(2)
    if rdzv.rank != 0:
        distributed.run_rank(config, rdzv)
        distributed.exit_stopped_rank()
    mg = distributed.data_parallel(config, rdzv, [], build_backend)
    from megatron.core import parallel_state

    dp_size = parallel_state.get_data_parallel_world_size()
    b = eight_trajectories()
    m_mg = mg.train_step(b)
    exported = mg.state_dict()
    mg.close()
    pt = TorchBackend(model_dir, lr=1e-3, micro_batch=4, loss=loss_config(config), device="cpu")
    m_pt = pt.train_step(b)
    reference = pt.model.state_dict()
    print(json.dumps({"data_parallel_size": dp_size, "loss_mg": m_mg["loss"], "loss_pt": m_pt["loss"],
                      "grad_norm_mg": m_mg["grad_norm"], "grad_norm_pt": m_pt["grad_norm"],
                      "weight_gap": max(float((exported[k] - reference[k]).abs().max()) for k in exported)}))


if __name__ == "__main__":
    main(sys.argv[1])
