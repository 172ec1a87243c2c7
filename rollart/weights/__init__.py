"""Weight publication and pull: the trainer writes each version once, in buckets, to a transport
(the Mooncake store, or a shared filesystem); generation consumers pull the buckets in the background
into a local staging directory and then load them into their engine during a short pause."""

from rollart.weights.buckets import pack_buckets, read_staged
from rollart.weights.transport import (
    FsTransport,
    MooncakeTransport,
    WeightTransport,
    WeightTransportError,
    make_transport,
)
from rollart.weights.publish import WeightPublisher, pull_version

__all__ = [
    "FsTransport",
    "MooncakeTransport",
    "WeightPublisher",
    "WeightTransport",
    "WeightTransportError",
    "make_transport",
    "pack_buckets",
    "pull_version",
    "read_staged",
]
