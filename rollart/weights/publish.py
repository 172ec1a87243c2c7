"""Publishing a version (trainer side) and pulling it (generation side).

The trainer writes each version once: ``pack_buckets`` → ``transport.put`` per bucket → a
:class:`WeightManifest` that names every bucket, carried by the VersionAnnouncement. A puller fetches
the buckets of a manifest into ``<staging>/v<version>/`` (a local directory the engine's worker
reads); that is the part that overlaps with generation. Old versions are removed by
:meth:`WeightPublisher.collect` once no generation consumer can still be pulling them.

With ``weights.sync: delta`` a version writes only the buckets whose digest changed; an unchanged
bucket keeps the key of the version that wrote it, so keys are shared between versions and
``collect`` removes a key only once no manifest it keeps names it. A changed bucket is written whole
(the fallback of any reader that does not hold the previous bytes) and, when much smaller, also as a
delta against the previous bytes. A puller holding the previous version (:class:`StagedVersion`)
links unchanged buckets, rebuilds changed ones from their deltas, and checks every digest.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from rollart.messages import BucketDelta, WeightBucket, WeightManifest
from rollart.weights.buckets import pack_buckets, staged_name
from rollart.weights.delta import DELTA_CODECS, DeltaError, bucket_digest, decode_delta, encode_delta, version_digest
from rollart.weights.transport import WeightTransport, WeightTransportError

log = logging.getLogger(__name__)

WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENCODE_THREADS = min(8, os.cpu_count() or 1)  # a trainer host's cores are idle while it publishes


def bucket_key(job: str, version: int, index: int) -> str:
    return f"{job}/v{version}/b{index}"


def delta_key(job: str, version: int, index: int) -> str:
    return f"{job}/v{version}/d{index}"


def manifest_keys(manifest: WeightManifest) -> set[str]:
    """Every transport key ``manifest`` names: its buckets' (some written by earlier versions) and deltas'."""
    keys = {b.key for b in manifest.buckets}
    return keys | {b.delta.key for b in manifest.buckets if b.delta is not None}


@dataclass
class PublishStats:
    """What the last :meth:`WeightPublisher.publish` wrote."""

    buckets: int = 0
    changed: int = 0  # buckets written (every bucket under full sync)
    deltas: int = 0  # changed buckets also written as a delta
    written_bytes: int = 0  # full buckets and deltas put into the transport


@dataclass
class WeightPublisher:
    transport: WeightTransport
    job: str
    bucket_bytes: int = 64 << 20
    dtype: str = "float32"
    sync: str = "full"  # weights.sync
    delta_encoding: bool = True
    codec: str = "sparse"  # weights.delta_codec
    delta_max_ratio: float = 0.5
    published: dict[int, WeightManifest] = field(default_factory=dict)
    last: PublishStats = field(default_factory=PublishStats)
    # delta sync: the newest version this process wrote, with its buckets' bytes (the base of the next
    # version's deltas: one copy of the weights in memory)
    _base: tuple[WeightManifest, list[bytes]] | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, transport: WeightTransport, job: str, weights) -> WeightPublisher:
        """A publisher set up by the job's ``weights`` section."""
        return cls(transport, job, bucket_bytes=weights.bucket_bytes, dtype=weights.dtype, sync=weights.sync,
                   delta_encoding=weights.delta_encoding, codec=weights.delta_codec,
                   delta_max_ratio=weights.delta_max_ratio)

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> tuple[WeightManifest, float]:
        """Write ``state`` as ``version``; returns the manifest and the seconds it took."""
        started = time.perf_counter()
        packed = pack_buckets(state, bucket_bytes=self.bucket_bytes, dtype=WEIGHT_DTYPES[self.dtype])
        self.last = PublishStats(buckets=len(packed))
        if self.sync == "delta":
            # digests and deltas in threads (sha256, numpy and zlib release the GIL), ahead of the puts,
            # which stay in order on this thread (a transport client need not be thread-safe)
            with ThreadPoolExecutor(max_workers=ENCODE_THREADS, thread_name_prefix="weights-delta") as pool:
                prepared = pool.map(self._prepare, range(len(packed)), packed)
                buckets = [self._put_changed(version, i, names, data, *prep)
                           for i, ((names, data), prep) in enumerate(zip(packed, prepared))]
            digest = version_digest([b.digest for b in buckets])
        else:
            buckets = [self._put_whole(version, i, names, data) for i, (names, data) in enumerate(packed)]
            digest = ""
        manifest = WeightManifest(transport=self.transport.name, location=self.transport.location,
                                  buckets=tuple(buckets), total_bytes=sum(b.nbytes for b in buckets),
                                  dtype=self.dtype, digest=digest)
        self.published[version] = manifest
        if self.sync == "delta":
            self._base = (manifest, [data for _, data in packed])
        return manifest, time.perf_counter() - started

    def _put_whole(self, version: int, index: int, names: tuple[str, ...], data: bytes,
                   digest: str = "") -> WeightBucket:
        key = bucket_key(self.job, version, index)
        self.transport.put(key, data)
        self.last.changed += 1
        self.last.written_bytes += len(data)
        return WeightBucket(key=key, nbytes=len(data), tensors=names, digest=digest)

    def _prepare(self, index: int, bucket: tuple[tuple[str, ...], bytes]) -> tuple[str, bytes | None]:
        """A bucket's digest, and its delta against the previous version's bytes when it changed and the
        delta is small enough to be worth it (else None)."""
        names, data = bucket
        digest = bucket_digest(data)
        previous, base = self._previous_bucket(index, names, len(data))
        if base is None or previous.digest == digest or not self.delta_encoding:
            return digest, None
        encoded = encode_delta(base, data, self.codec)
        # most weights changed: rebuilding would cost the reader more than it saves
        return digest, encoded if len(encoded) <= self.delta_max_ratio * len(data) else None

    def _put_changed(self, version: int, index: int, names: tuple[str, ...], data: bytes, digest: str,
                     encoded: bytes | None) -> WeightBucket:
        """Delta sync: the bucket as the previous version's (unchanged), or written whole (plus its delta)."""
        previous, _ = self._previous_bucket(index, names, len(data))
        if previous is not None and previous.digest == digest:
            # the same bytes: the new manifest names the key that already holds them (without the delta
            # that made them, which is against a version before the previous one)
            return replace(previous, delta=None)
        bucket = self._put_whole(version, index, names, data, digest)
        if encoded is None:
            return bucket
        key = delta_key(self.job, version, index)
        self.transport.put(key, encoded)
        self.last.deltas += 1
        self.last.written_bytes += len(encoded)
        return WeightBucket(key=bucket.key, nbytes=bucket.nbytes, tensors=names, digest=digest,
                            delta=BucketDelta(key=key, nbytes=len(encoded), base_digest=previous.digest,
                                              codec=DELTA_CODECS[self.codec]))

    def _previous_bucket(self, index: int, names: tuple[str, ...], nbytes: int) -> tuple[WeightBucket | None,
                                                                                         bytes | None]:
        """The previous version's bucket at ``index`` and its bytes, when it holds the same tensors in
        the same layout (else a delta would not line up)."""
        if self._base is None or index >= len(self._base[0].buckets):
            return None, None
        manifest, data = self._base
        previous = manifest.buckets[index]
        if previous.tensors != names or previous.nbytes != nbytes or not previous.digest:
            return None, None
        return previous, data[index]

    def collect(self, keep_from: int) -> list[int]:
        """Remove every version below ``keep_from``; returns those removed (leased ones wait). A key that
        a kept manifest (or the base of the next version's deltas) still names is left in place."""
        live = set().union(*(manifest_keys(m) for v, m in self.published.items() if v >= keep_from))
        if self._base is not None:
            live |= manifest_keys(self._base[0])
        removed = []
        for version in sorted(v for v in self.published if v < keep_from):
            try:
                self.transport.remove(sorted(manifest_keys(self.published[version]) - live))
            except WeightTransportError:
                continue
            del self.published[version]
            removed.append(version)
        return removed


@dataclass(frozen=True)
class StagedVersion:
    """A version a puller holds on local disk: the base its next pull rebuilds changed buckets from."""

    version: int
    directory: Path
    manifest: WeightManifest


@dataclass
class PullResult:
    directory: Path
    pulled_bytes: int = 0  # read from the transport (full buckets and deltas)
    reused: int = 0  # buckets the base already held (linked, not pulled)
    deltas: int = 0  # buckets rebuilt from a delta
    whole: int = 0  # buckets pulled whole
    fallbacks: int = 0  # deltas that could not be applied (base not held, corrupt, unknown codec): pulled whole


def pull_version(transport: WeightTransport, manifest: WeightManifest, version: int,
                 staging: str | Path) -> Path:
    """Fetch every bucket of ``manifest`` into ``<staging>/v<version>/``; returns that directory."""
    return sync_version(transport, manifest, version, staging).directory


def sync_version(transport: WeightTransport, manifest: WeightManifest, version: int, staging: str | Path,
                 base: StagedVersion | None = None) -> PullResult:
    """Stage ``manifest`` into ``<staging>/v<version>/``: buckets ``base`` holds are linked, changed ones
    rebuilt from a delta against ``base`` where possible, the rest pulled whole; every digest the
    manifest carries is checked (a bad delta falls back to the whole bucket, a bad whole bucket fails)."""
    staging = Path(staging)
    target = staging / f"v{version}"
    partial = staging / f".v{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    held = _held_buckets(base)
    result = PullResult(target)
    for i, bucket in enumerate(manifest.buckets):
        path = partial / staged_name(i)
        if bucket.digest and bucket.digest in held:
            _link_or_copy(held[bucket.digest], path)
            result.reused += 1
            continue
        data = _rebuild(transport, bucket, held, result) if bucket.delta is not None else None
        if data is None:
            data = _pull_whole(transport, bucket, result)
        path.write_bytes(data)
    if manifest.digest and version_digest([b.digest for b in manifest.buckets]) != manifest.digest:
        # every bucket matched its own digest: the manifest's buckets are not the version it names
        raise WeightTransportError(f"version {version}: the buckets' digests do not make the version digest")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return result


def _held_buckets(base: StagedVersion | None) -> dict[str, Path]:
    """Digest -> staged file of every bucket ``base`` holds (none for a base without digests)."""
    if base is None or not base.directory.is_dir():
        return {}
    return {b.digest: base.directory / staged_name(i) for i, b in enumerate(base.manifest.buckets) if b.digest}


def _link_or_copy(source: Path, path: Path) -> None:
    # a hard link: the unchanged bucket costs no copy and no disk, and outlives the base's removal
    try:
        os.link(source, path)
    except OSError:
        shutil.copyfile(source, path)


def _rebuild(transport: WeightTransport, bucket: WeightBucket, held: dict[str, Path],
             result: PullResult) -> bytes | None:
    """The bucket from its delta and the held base; None (and a fallback counted) when that fails."""
    delta = bucket.delta
    base_path = held.get(delta.base_digest)
    if base_path is None:
        result.fallbacks += 1  # missed the base version: this bucket comes whole
        return None
    try:
        encoded = transport.get(delta.key)
        result.pulled_bytes += len(encoded)
        data = decode_delta(base_path.read_bytes(), encoded, delta.codec)
    except (WeightTransportError, DeltaError) as exc:
        log.warning("bucket %s: delta %s not applied (%s); pulling it whole", bucket.key, delta.key, exc)
        result.fallbacks += 1
        return None
    if bucket_digest(data) != bucket.digest:
        log.warning("bucket %s: rebuilt from delta %s, digest mismatch; pulling it whole", bucket.key, delta.key)
        result.fallbacks += 1
        return None
    result.deltas += 1
    return data


def _pull_whole(transport: WeightTransport, bucket: WeightBucket, result: PullResult) -> bytes:
    data = transport.get(bucket.key)
    result.pulled_bytes += len(data)
    result.whole += 1
    if len(data) != bucket.nbytes:
        raise WeightTransportError(f"bucket {bucket.key}: {len(data)} bytes, manifest says {bucket.nbytes}")
    if bucket.digest and bucket_digest(data) != bucket.digest:
        raise WeightTransportError(f"bucket {bucket.key}: its bytes do not match the manifest's digest")
    return data
