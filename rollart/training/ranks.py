"""Who a trainer rank is and where the ranks meet (torch.distributed's ``env://`` names), without
importing torch: `rollart deploy render` writes these into the trainer's pods.

Under torchrun (or any launcher) ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` name
it. In the Kubernetes rendering rank 0 is the trainer Deployment (``RANK=0``) and ranks 1..N-1 a
StatefulSet, whose pods learn their rank from their pod index (``TRAINER_WORKER_INDEX``: rank =
index + 1). Without either, `rollart consume trainer` is the launcher of its own local ranks.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

RENDEZVOUS_PORT = 29500  # torchrun's default MASTER_PORT
WORKER_INDEX_ENV = "TRAINER_WORKER_INDEX"  # a StatefulSet rank's pod index (rank = index + 1)


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    addr: str
    port: int

    @classmethod
    def from_env(cls, world_size: int) -> "Rendezvous | None":
        """The rank the environment gives this process, or None: nothing names one (the launcher)."""
        if "RANK" in os.environ:
            rank = int(os.environ["RANK"])
        elif WORKER_INDEX_ENV in os.environ:
            rank = int(os.environ[WORKER_INDEX_ENV]) + 1
        else:
            return None
        size = int(os.environ.get("WORLD_SIZE", world_size))
        if size != world_size:
            raise ValueError(f"trainer.world_size is {world_size} but WORLD_SIZE is {size}")
        if not 0 <= rank < size:
            raise ValueError(f"trainer rank {rank} is outside WORLD_SIZE {size}")
        return cls(rank, size, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   int(os.environ.get("MASTER_PORT", RENDEZVOUS_PORT)))

    @classmethod
    def local(cls, world_size: int) -> "Rendezvous":
        """Rank 0 of ranks this process starts itself, on a free local port."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return cls(0, world_size, "127.0.0.1", port)

    def env(self, rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "MASTER_ADDR": self.addr,
                "MASTER_PORT": str(self.port)}
