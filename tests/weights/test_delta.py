"""Delta weight sync (weights.sync: delta) on real tensors and a real filesystem transport: unchanged
buckets are not written again, changed ones travel as XOR deltas, every digest is checked, and a
follower that cannot apply a delta pulls the bucket whole and still ends bit-identical."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest
import torch

from rollart.config import ConfigError, build_config
from rollart.messages import Codec, VersionAnnouncement, WeightManifest
from rollart.weights import FsTransport, WeightPublisher, WeightTransportError, read_staged
from rollart.weights.buckets import pack_buckets
from rollart.weights.delta import DELTA_CODECS, DeltaError, decode_delta, encode_delta
from rollart.weights.publish import StagedVersion, manifest_keys, sync_version

BUCKET_BYTES = 16_400  # three buckets: two 64x32 float32 weights (8 KiB each), two more, the bias


def _state(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(64, 32) for i in range(4)}
    state["layer4.bias"] = torch.randn(32)
    return {k: v.to(dtype) for k, v in state.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (NaN payloads and signed zeros compare as themselves)."""
    return t.contiguous().view(torch.uint8)


def _assert_bit_identical(directory, state: dict[str, torch.Tensor]) -> None:
    staged = dict(read_staged(directory))
    assert set(staged) == set(state)
    for name, tensor in state.items():
        assert torch.equal(_bits(staged[name]), _bits(tensor)), name


def _nudge(state: dict[str, torch.Tensor], names: list[str], fraction: float = 0.03, seed: int = 1):
    """A copy of ``state`` with ``fraction`` of the elements of ``names`` changed (an RL step's few)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    for name in names:
        flat = out[name].view(-1)
        picked = torch.rand(flat.numel(), generator=g) < fraction
        flat[picked] = flat[picked] + 0.5
    return out


@dataclass
class Follower:
    """A generation consumer's side of delta sync: stages each version against the one it holds."""

    transport: FsTransport
    staging: object
    base: StagedVersion | None = None
    pulls: list = field(default_factory=list)

    def sync(self, manifest: WeightManifest, version: int):
        result = sync_version(self.transport, manifest, version, self.staging, self.base)
        self.base = StagedVersion(version, result.directory, manifest)
        self.pulls.append(result)
        return result


def _delta_publisher(tmp_path, **kwargs) -> WeightPublisher:
    return WeightPublisher(FsTransport(tmp_path / "store"), "job", bucket_bytes=BUCKET_BYTES, sync="delta", **kwargs)


def test_unchanged_buckets_are_not_written_or_pulled_again(tmp_path):
    publisher = _delta_publisher(tmp_path)
    v1 = _state()
    m1, _ = publisher.publish(1, v1)
    assert publisher.last.changed == publisher.last.buckets == len(m1.buckets) == 3
    v2 = _nudge(v1, ["layer2.weight"])
    m2, _ = publisher.publish(2, v2)
    assert publisher.last.changed == 1 and publisher.last.deltas == 1
    assert [b.key for b in m2.buckets] == ["job/v1/b0", "job/v2/b1", "job/v1/b2"], \
        "unchanged buckets keep version 1's keys; only the changed one is written under v2"
    assert sorted(p.name for p in (tmp_path / "store" / "job" / "v2").iterdir()) == ["b1", "d1"]
    assert m2.digest and m2.digest != m1.digest and m2.buckets[1].delta.base_digest == m1.buckets[1].digest

    follower = Follower(publisher.transport, tmp_path / "staging")
    first = follower.sync(m1, 1)
    assert first.pulled_bytes == m1.total_bytes and first.whole == 3
    second = follower.sync(m2, 2)
    assert (second.reused, second.deltas, second.whole, second.fallbacks) == (2, 1, 0, 0)
    assert second.pulled_bytes == m2.buckets[1].delta.nbytes < m2.buckets[1].nbytes / 4
    _assert_bit_identical(second.directory, v2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xor_delta_round_trips_bit_exactly(dtype):
    base = _state(dtype)
    new = _nudge(base, list(base))
    special = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 1e-40], dtype=dtype)
    new["layer0.weight"].view(-1)[:6] = special  # NaN, signed zero, infinities and a subnormal survive
    ((_, old_bytes),) = pack_buckets(base, bucket_bytes=1 << 30)
    ((_, new_bytes),) = pack_buckets(new, bucket_bytes=1 << 30)
    for name, codec in DELTA_CODECS.items():
        encoded = encode_delta(old_bytes, new_bytes, name)
        assert len(encoded) < len(new_bytes) / 2, name
        rebuilt = decode_delta(old_bytes, encoded, codec)
        assert rebuilt == new_bytes, name
    from safetensors.torch import load

    restored = load(rebuilt)
    for name, tensor in new.items():
        assert restored[name].dtype == dtype and torch.equal(_bits(restored[name]), _bits(tensor))
    with pytest.raises(DeltaError, match="unknown delta codec"):
        decode_delta(old_bytes, encoded, "xor+brotli")


def test_a_follower_that_skipped_a_version_pulls_whole_and_ends_bit_identical(tmp_path):
    publisher = _delta_publisher(tmp_path)
    states = {1: _state()}
    states[2] = _nudge(states[1], list(states[1]), seed=2)
    states[3] = _nudge(states[2], list(states[2]), seed=3)  # every bucket changes in every version
    manifests = {v: publisher.publish(v, s)[0] for v, s in states.items()}
    assert all(b.delta is not None for b in manifests[3].buckets), "deltas against version 2"

    follower = Follower(publisher.transport, tmp_path / "staging")
    follower.sync(manifests[1], 1)
    skipped = follower.sync(manifests[3], 3)  # holds 1, the deltas are against 2
    assert (skipped.reused, skipped.deltas, skipped.whole, skipped.fallbacks) == (0, 0, 3, 3)
    assert skipped.pulled_bytes == manifests[3].total_bytes, "a full pull, and no delta read for nothing"
    _assert_bit_identical(skipped.directory, states[3])


@pytest.mark.parametrize("codec", ["sparse", "zlib"])
def test_a_corrupted_delta_is_caught_by_the_digest_and_the_bucket_pulled_whole(tmp_path, codec):
    publisher = _delta_publisher(tmp_path, codec=codec)
    v1 = _state()
    v2 = _nudge(v1, list(v1))
    m1, _ = publisher.publish(1, v1)
    m2, _ = publisher.publish(2, v2)
    (_, b1), (_, n1) = pack_buckets(v1, bucket_bytes=BUCKET_BYTES)[0], pack_buckets(v2, bucket_bytes=BUCKET_BYTES)[0]
    wrong = bytearray(n1)
    wrong[-1] ^= 1  # a well-formed delta of the wrong content: only the digest can tell
    publisher.transport.put(m2.buckets[0].delta.key, encode_delta(b1, bytes(wrong), publisher.codec))
    publisher.transport.put(m2.buckets[1].delta.key, b"\x00not a delta")  # a delta that does not decode

    follower = Follower(publisher.transport, tmp_path / "staging")
    follower.sync(m1, 1)
    result = follower.sync(m2, 2)
    assert (result.deltas, result.fallbacks, result.whole) == (1, 2, 2)
    _assert_bit_identical(result.directory, v2)

    publisher.transport.put(m2.buckets[2].key, b"x" * m2.buckets[2].nbytes)  # the whole copy itself is bad
    with pytest.raises(WeightTransportError, match="digest"):
        sync_version(publisher.transport, m2, 2, tmp_path / "fresh")


def test_collect_keeps_buckets_a_kept_version_still_names(tmp_path):
    publisher = _delta_publisher(tmp_path)
    states = {1: _state()}
    states[2] = _nudge(states[1], ["layer0.weight"], seed=2)
    states[3] = _nudge(states[2], ["layer2.weight"], seed=3)
    manifests = {v: publisher.publish(v, s)[0] for v, s in states.items()}
    assert manifests[3].buckets[2].key == "job/v1/b2", "shared since version 1"
    assert manifests[2].buckets[0].delta and manifests[3].buckets[0].delta is None, \
        "an unchanged bucket is named without the delta that made it (against version 1)"

    assert publisher.collect(keep_from=3) == [1, 2]
    assert sorted(publisher.published) == [3]
    stored = {str(p.relative_to(tmp_path / "store")) for p in (tmp_path / "store").rglob("*") if p.is_file()}
    assert stored == manifest_keys(manifests[3]), "exactly what version 3 names is left"
    _assert_bit_identical(sync_version(publisher.transport, manifests[3], 3, tmp_path / "s").directory, states[3])

    assert publisher.collect(keep_from=4) == [3], "the newest version can be collected from the log..."
    _assert_bit_identical(sync_version(publisher.transport, manifests[3], 3, tmp_path / "t").directory, states[3])
    m4, _ = publisher.publish(4, _nudge(states[3], ["layer4.bias"], seed=4))
    assert manifest_keys(m4) & manifest_keys(manifests[3]), "...but its buckets stay: the next version names them"
    sync_version(publisher.transport, m4, 4, tmp_path / "u")


# The announcement as a 1.0 writer sent it (no digests, no deltas) and as a 1.0 reader decodes it.
@dataclass(frozen=True)
class OldBucket:
    key: str
    nbytes: int
    tensors: tuple[str, ...] = ()


@dataclass(frozen=True)
class OldManifest:
    transport: str
    location: str = ""
    buckets: tuple[OldBucket, ...] = ()
    total_bytes: int = 0
    dtype: str = ""


@dataclass(frozen=True)
class OldAnnouncement:
    job: str
    version: int
    step: int = 0
    manifest: OldManifest | None = None
    published_at: float = 0.0


def test_a_1_0_manifest_without_digests_decodes_and_is_pulled_whole(tmp_path):
    full = WeightPublisher(FsTransport(tmp_path / "store"), "old", bucket_bytes=BUCKET_BYTES)  # sync: full
    v1, v2 = _state(), _nudge(_state(), ["layer0.weight"])
    m1, _ = full.publish(1, v1)
    m2, _ = full.publish(2, v2)
    old = OldAnnouncement("job", 2, manifest=OldManifest("fs", buckets=tuple(
        OldBucket(b.key, b.nbytes, b.tensors) for b in m2.buckets), total_bytes=m2.total_bytes))
    headers = [("rollart-schema", b"VersionAnnouncement/1.0"), ("content-type", b"application/msgpack")]
    decoded = Codec().decode(msgspec.msgpack.encode(old), headers).message
    assert decoded.manifest.digest == "" and all(b.digest == "" and b.delta is None for b in decoded.manifest.buckets)

    follower = Follower(full.transport, tmp_path / "staging")
    follower.sync(m1, 1)
    result = follower.sync(decoded.manifest, 2)
    assert result.whole == 3 and result.reused == 0 and result.pulled_bytes == m2.total_bytes
    _assert_bit_identical(result.directory, v2)


def test_a_1_0_reader_decodes_a_delta_announcement_and_its_keys_hold_whole_buckets(tmp_path):
    publisher = _delta_publisher(tmp_path)
    v1 = _state()
    publisher.publish(1, v1)
    v2 = _nudge(v1, ["layer0.weight"])
    m2, _ = publisher.publish(2, v2)
    headers, value = Codec().encode(VersionAnnouncement("job", 2, manifest=m2), job="job")
    assert dict(headers)["rollart-schema"] == b"VersionAnnouncement/1.1"
    old = msgspec.msgpack.decode(value, type=OldAnnouncement)  # a 1.0 reader ignores the new fields
    for bucket in old.manifest.buckets:  # and pulls each key as it always did
        assert len(publisher.transport.get(bucket.key)) == bucket.nbytes
    assert old.manifest.total_bytes == m2.total_bytes


def test_delta_options_need_delta_sync():
    with pytest.raises(ConfigError, match="weights.delta_max_ratio is set but weights.sync is full"):
        build_config({"weights": {"delta_max_ratio": 0.3}})
    with pytest.raises(ConfigError, match="delta_max_ratio"):
        build_config({"weights": {"sync": "delta", "delta_max_ratio": 0}})
    weights = build_config({"weights": {"sync": "delta", "delta_codec": "lzma"}}).weights
    assert (weights.sync, weights.delta_encoding, weights.delta_codec) == ("delta", True, "lzma")
    assert WeightPublisher.from_config(FsTransport("/nonexistent"), "j", weights).codec == "lzma"


async def test_a_follower_keeps_the_version_it_staged_as_its_next_base(tmp_path):
    """The follower's staging step (rollart.weights.follower.stage_version): the staged version becomes
    the base only under delta sync, and the older base is removed once the new one is staged."""
    from rollart.weights.follower import stage_version

    publisher = _delta_publisher(tmp_path)
    v1 = _state()
    v2 = _nudge(v1, ["layer0.weight"])
    announce = {v: VersionAnnouncement("job", v, manifest=publisher.publish(v, s)[0]) for v, s in ((1, v1), (2, v2))}
    staging = tmp_path / "staging"
    pulled, base, _ = await stage_version(publisher.transport, announce[1], staging, None)
    assert base == StagedVersion(1, staging / "v1", announce[1].manifest) and pulled.whole == 3
    pulled, base, _ = await stage_version(publisher.transport, announce[2], staging, base)
    assert (pulled.reused, pulled.deltas) == (2, 1) and base.directory == staging / "v2"
    assert sorted(p.name for p in staging.iterdir()) == ["v2"], "the old base is gone, its shared files linked"
    _assert_bit_identical(base.directory, v2)

    full = WeightPublisher(FsTransport(tmp_path / "full"), "job", bucket_bytes=BUCKET_BYTES)
    plain = VersionAnnouncement("job", 3, manifest=full.publish(3, v2)[0])
    pulled, base, _ = await stage_version(full.transport, plain, staging, base)
    assert base is None and pulled.whole == 3, "no digests (full sync): nothing to keep as a base"


def test_a_whole_config_dumped_and_loaded_again_stays_valid():
    """Deploy and some benches dump every field and load them again: defaults must not read as 'set'."""
    from rollart.config import RollartConfig

    config = build_config({})
    again = build_config(config.model_dump(mode="json", exclude_none=True, exclude={"deploy"}))
    assert again.weights == config.weights and again.weights.sync == "full"
    assert isinstance(again, RollartConfig)
