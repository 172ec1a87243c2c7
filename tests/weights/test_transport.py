"""Weight buckets and transports: the filesystem and the real Mooncake store of the test stack."""

from __future__ import annotations

import pytest
import torch

from rollart.config import WeightsConfig
from rollart.weights import (
    FsTransport,
    WeightPublisher,
    WeightTransportError,
    make_transport,
    pack_buckets,
    pull_version,
    read_staged,
)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    embed = torch.randn(64, 32)
    return {"embed.weight": embed, "layer.weight": torch.randn(32, 32), "layer.bias": torch.randn(32),
            "lm_head.weight": embed}  # tied to the embedding


def test_buckets_respect_the_size_bound_and_round_trip(tmp_path):
    state = _state()
    buckets = pack_buckets(state, bucket_bytes=5000)
    names = [n for names, _ in buckets for n in names]
    assert names == ["embed.weight", "layer.weight", "layer.bias"], "tied lm_head is written once"
    assert [names for names, _ in buckets] == [("embed.weight",), ("layer.weight", "layer.bias")], \
        "a tensor over the bound is alone; smaller ones share a bucket up to the bound"
    for i, (_, data) in enumerate(buckets):
        (tmp_path / f"bucket-{i:05d}.safetensors").write_bytes(data)
    restored = dict(read_staged(tmp_path))
    assert set(restored) == set(names)
    for name in names:
        assert torch.equal(restored[name], state[name])


def test_fs_transport_refuses_keys_outside_its_root(tmp_path):
    transport = FsTransport(tmp_path / "w")
    with pytest.raises(WeightTransportError, match="escapes"):
        transport.put("../outside", b"x")
    with pytest.raises(WeightTransportError, match="cannot read"):
        transport.get("job/v1/b0")


@pytest.mark.parametrize("kind", ["fs", "mooncake"])
def test_publish_pull_collect(kind, tmp_path, endpoints):
    transport = make_transport(WeightsConfig(transport=kind, fs_root=tmp_path / "root"), endpoints)
    assert transport.name == kind
    publisher = WeightPublisher(transport, f"job-{kind}-{tmp_path.name}", bucket_bytes=4096)
    state = _state()
    manifests = {}
    for version in (1, 2, 3):
        scaled = {k: v * version for k, v in state.items()}
        manifests[version], _ = publisher.publish(version, scaled)
    assert manifests[3].total_bytes == sum(b.nbytes for b in manifests[3].buckets) > 0
    staged = pull_version(transport, manifests[2], 2, tmp_path / "staging")
    restored = dict(read_staged(staged))
    assert torch.allclose(restored["layer.weight"], state["layer.weight"] * 2)

    import time

    deadline = time.monotonic() + 10  # Mooncake leases a key it served for a moment
    while set(publisher.published) != {3} and time.monotonic() < deadline:
        publisher.collect(keep_from=3)
        time.sleep(0.2)
    assert set(publisher.published) == {3}
    with pytest.raises(WeightTransportError):
        pull_version(transport, manifests[1], 1, tmp_path / "staging")
    assert dict(read_staged(pull_version(transport, manifests[3], 3, tmp_path / "staging")))
    transport.close()


def test_a_bucket_of_the_wrong_size_is_refused(tmp_path):
    from dataclasses import replace

    transport = FsTransport(tmp_path / "root")
    manifest, _ = WeightPublisher(transport, "j", bucket_bytes=1 << 20).publish(1, _state())
    bad = replace(manifest, buckets=(replace(manifest.buckets[0], nbytes=manifest.buckets[0].nbytes + 1),))
    with pytest.raises(WeightTransportError, match="manifest says"):
        pull_version(transport, bad, 1, tmp_path / "staging")
