"""Typed, versioned messages and the one codec that puts them on the wire."""

from rollart.messages.arrays import Float32Array, Int32Array, PackedArray, UInt8Array
from rollart.messages.codec import DEFAULT_CODEC, Codec, Envelope, MessageDecodeError
from rollart.messages.kinds import (
    MESSAGE_KINDS,
    REPLACEMENT_MARK,
    Abort,
    BucketDelta,
    CompletedTrajectory,
    EvalSummary,
    EvalTagResult,
    GenerationRequest,
    GenerationResult,
    GroupEnded,
    SamplingParams,
    ScoredTrajectory,
    TaskSpec,
    VersionAnnouncement,
    WeightBucket,
    WeightManifest,
)

__all__ = [
    "Abort",
    "BucketDelta",
    "Codec",
    "CompletedTrajectory",
    "EvalSummary",
    "EvalTagResult",
    "DEFAULT_CODEC",
    "Envelope",
    "Float32Array",
    "GenerationRequest",
    "GenerationResult",
    "GroupEnded",
    "Int32Array",
    "MESSAGE_KINDS",
    "MessageDecodeError",
    "PackedArray",
    "REPLACEMENT_MARK",
    "SamplingParams",
    "ScoredTrajectory",
    "TaskSpec",
    "UInt8Array",
    "VersionAnnouncement",
    "WeightBucket",
    "WeightManifest",
]
