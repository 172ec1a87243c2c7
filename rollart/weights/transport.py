"""Where weight buckets live between the trainer and the generation consumers.

* :class:`MooncakeTransport`: the Mooncake distributed store (``mooncake_master`` + a store process
  contributing memory; TCP here, RDMA on clusters). Keys are ``<job>/v<version>/b<i>``.
* :class:`FsTransport`: a directory every stage can read (NFS, a shared volume, or one machine).

Calls are blocking (Mooncake's client is C++); callers run them in a thread.
"""

from __future__ import annotations

import os
import contextlib
import socket
from pathlib import Path
from typing import Protocol


class WeightTransportError(RuntimeError):
    """A bucket could not be written, read or removed."""


class WeightTransport(Protocol):
    name: str
    location: str

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def remove(self, keys: list[str]) -> None: ...

    def close(self) -> None: ...


class FsTransport:
    name = "fs"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.location = str(self.root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise WeightTransportError(f"bucket key {key!r} escapes the weight root {self.root}")
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # readers never see a half-written bucket

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise WeightTransportError(f"cannot read bucket {key} under {self.root}: {exc.strerror}") from None

    def remove(self, keys: list[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parents.add(path.parent)
        for parent in parents:
            with contextlib.suppress(OSError):
                parent.rmdir()  # only once empty

    def close(self) -> None:
        pass


class MooncakeTransport:
    """A Mooncake store client. It contributes no memory itself (``global_segment_size=0``): the
    store process the stack runs holds the data, so buckets outlive a crashed trainer."""

    name = "mooncake"

    def __init__(self, master: str, metadata_server: str, *, local_buffer_bytes: int = 64 << 20,
                 protocol: str = "tcp", hostname: str | None = None):
        from mooncake.store import MooncakeDistributedStore

        self.location = master
        self.store = MooncakeDistributedStore()
        host = hostname or ("127.0.0.1" if master.startswith(("127.", "localhost")) else socket.gethostname())
        rc = self.store.setup(host, metadata_server, 0, local_buffer_bytes, protocol, "", master)
        if rc != 0:
            raise WeightTransportError(f"Mooncake setup failed (code {rc}) with master {master}, "
                                       f"metadata server {metadata_server}")

    def put(self, key: str, data: bytes) -> None:
        # upsert: a trainer resumed from a checkpoint may write a version's keys again
        rc = self.store.upsert(key, data)
        if rc != 0:
            raise WeightTransportError(f"Mooncake put {key} ({len(data)} bytes) failed with code {rc}")

    def get(self, key: str) -> bytes:
        data = self.store.get(key)
        if not data:
            raise WeightTransportError(f"Mooncake has no bucket {key} (evicted or never written)")
        return bytes(data)

    def remove(self, keys: list[str]) -> None:
        # force: skip the read lease the master holds on a key served a moment ago. The collector
        # only removes versions that no generation consumer is pulling (it checks first).
        left = [k for k in keys if self.store.remove(k, force=True) != 0 and self.store.is_exist(k) == 1]
        if left:
            raise WeightTransportError(f"{len(left)} bucket(s) still leased, e.g. {left[0]}")

    def close(self) -> None:
        self.store.close()


def make_transport(weights_config, endpoints) -> WeightTransport:
    """The configured transport; ``auto`` takes Mooncake when a master is known, else the filesystem."""
    kind = weights_config.transport
    master = getattr(endpoints, "mooncake_master", None)
    metadata = getattr(endpoints, "mooncake_metadata", None)
    if kind == "mooncake" or (kind == "auto" and master and metadata):
        if not (master and metadata):
            raise WeightTransportError("weights.transport is mooncake but no Mooncake master / metadata server "
                                       "is configured (mooncake.master, mooncake.metadata_server) or running")
        return MooncakeTransport(master, metadata, local_buffer_bytes=weights_config.bucket_bytes * 2)
    root = weights_config.fs_root
    if root is None:
        from rollart.local.state import rollart_home

        root = rollart_home() / "weights"
    return FsTransport(root)
