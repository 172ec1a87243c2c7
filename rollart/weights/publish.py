"""Publishing a version (trainer side) and pulling it (generation side).

The trainer writes each version once: ``pack_buckets`` → ``transport.put`` per bucket → a
:class:`WeightManifest` that names every bucket, carried by the VersionAnnouncement. A puller fetches
the buckets of a manifest into ``<staging>/v<version>/`` (a local directory the engine's worker
reads); that is the part that overlaps with generation. Old versions are removed by
:meth:`WeightPublisher.collect` once no generation consumer can still be pulling them.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollart.messages import WeightBucket, WeightManifest
from rollart.weights.buckets import pack_buckets, staged_name
from rollart.weights.transport import WeightTransport, WeightTransportError

WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WeightPublisher:
    transport: WeightTransport
    job: str
    bucket_bytes: int = 64 << 20
    dtype: str = "float32"
    published: dict[int, WeightManifest] = field(default_factory=dict)

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> tuple[WeightManifest, float]:
        """Write ``state`` as ``version``; returns the manifest and the seconds it took."""
        started = time.perf_counter()
        buckets = []
        for i, (names, data) in enumerate(pack_buckets(state, bucket_bytes=self.bucket_bytes,
                                                       dtype=WEIGHT_DTYPES[self.dtype])):
            key = f"{self.job}/v{version}/b{i}"
            self.transport.put(key, data)
            buckets.append(WeightBucket(key=key, nbytes=len(data), tensors=names))
        manifest = WeightManifest(transport=self.transport.name, location=self.transport.location,
                                  buckets=tuple(buckets), total_bytes=sum(b.nbytes for b in buckets),
                                  dtype=self.dtype)
        self.published[version] = manifest
        return manifest, time.perf_counter() - started

    def collect(self, keep_from: int) -> list[int]:
        """Remove every version below ``keep_from``; returns those removed (leased ones wait)."""
        removed = []
        for version in sorted(v for v in self.published if v < keep_from):
            try:
                self.transport.remove([b.key for b in self.published[version].buckets])
            except WeightTransportError:
                continue
            del self.published[version]
            removed.append(version)
        return removed


def pull_version(transport: WeightTransport, manifest: WeightManifest, version: int,
                 staging: str | Path) -> Path:
    """Fetch every bucket of ``manifest`` into ``<staging>/v<version>/``; returns that directory."""
    staging = Path(staging)
    target = staging / f"v{version}"
    partial = staging / f".v{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for i, bucket in enumerate(manifest.buckets):
        data = transport.get(bucket.key)
        if len(data) != bucket.nbytes:
            raise WeightTransportError(f"bucket {bucket.key}: {len(data)} bytes, manifest says {bucket.nbytes}")
        (partial / staged_name(i)).write_bytes(data)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target
