"""Split a state dict into size-bounded buckets of safetensors bytes, and read staged buckets back.

safetensors (not pickle) is the wire format: a bucket is a flat header plus raw tensor bytes, so a
puller never executes anything it receives, and the staged files load with ``safe_open``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors.torch import load_file, save


def pack_buckets(state: Mapping[str, torch.Tensor], *, bucket_bytes: int,
                 dtype: torch.dtype | None = None) -> list[tuple[tuple[str, ...], bytes]]:
    """``[(tensor names, safetensors bytes)]``, each bucket at most ``bucket_bytes`` unless one tensor
    alone is larger. Tied tensors (the same storage under two names) are written once."""
    buckets: list[tuple[tuple[str, ...], bytes]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[int] = set()
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen and tensor.numel() > 0:
            continue  # tied weights (embedding / lm_head): the engine ties them itself
        seen.add(ptr)
        t = tensor.detach().to("cpu", dtype=dtype or tensor.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append((tuple(current), save(current)))
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current:
        buckets.append((tuple(current), save(current)))
    return buckets


def staged_name(index: int) -> str:
    """A staged bucket's file name; :func:`read_staged` reads them in this order."""
    return f"bucket-{index:05d}.safetensors"


def stage_state(state: Mapping[str, torch.Tensor], directory: str | Path, *, bucket_bytes: int,
                dtype: torch.dtype | None = None) -> Path:
    """Write ``state`` as staged buckets into ``directory`` (what an engine loads), without a transport."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for i, (_, data) in enumerate(pack_buckets(state, bucket_bytes=bucket_bytes, dtype=dtype)):
        (directory / staged_name(i)).write_bytes(data)
    return directory


def read_staged(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of the bucket files staged in ``directory``, in bucket order."""
    for path in sorted(Path(directory).glob("bucket-*.safetensors")):
        yield from load_file(path).items()
