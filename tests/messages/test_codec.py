"""The codec: every kind round-trips; every way a message can be wrong gives one error naming the field."""

from __future__ import annotations

import msgpack
import pytest

from rollart.messages import (
    DEFAULT_CODEC,
    MESSAGE_KINDS,
    Abort,
    Codec,
    GenerationRequest,
    GenerationResult,
    Int32Array,
    MessageDecodeError,
    TaskSpec,
)
from rollart.messages.codec import H_ID, H_JOB, H_POLICY_VERSION, H_SCHEMA
from rollart.messages.samples import sample_messages


def _headers(headers, **replace):
    out = dict(headers)
    out.update({k: v.encode() for k, v in replace.items()})
    return list(out.items())


def test_samples_cover_every_kind():
    assert {type(m) for m in sample_messages()} == set(MESSAGE_KINDS)


@pytest.mark.parametrize("message", sample_messages(), ids=lambda m: m.KIND)
def test_round_trip_every_kind(message):
    headers, value = DEFAULT_CODEC.encode(message, job="job1", policy_version=7)
    envelope = DEFAULT_CODEC.decode(value, headers)
    assert envelope.message == message
    assert type(envelope.message) is type(message)
    assert envelope.kind == message.KIND
    assert envelope.message_id == message.message_id()
    assert envelope.job == "job1"
    assert envelope.policy_version == 7
    names = dict(headers)
    assert names[H_SCHEMA] == f"{message.KIND}/{message.SCHEMA[0]}.{message.SCHEMA[1]}".encode()
    assert names["content-type"] == b"application/msgpack"


def test_token_arrays_are_packed_bytes_on_the_wire():
    message = next(m for m in sample_messages(tokens=100) if isinstance(m, GenerationResult))
    _, value = DEFAULT_CODEC.encode(message, job="j")
    raw = msgpack.unpackb(value)
    assert isinstance(raw["token_ids"], bytes) and len(raw["token_ids"]) == 4 * 100
    assert isinstance(raw["logprobs"], bytes) and len(raw["logprobs"]) == 4 * 100
    assert raw["token_ids"][:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"  # little-endian int32


def test_message_ids_are_deterministic():
    a = Abort(traj_id="x", turn=3, reason="r")
    assert a.message_id() == Abort(traj_id="x", turn=3, reason="other").message_id() == "abort:x::3"
    assert TaskSpec(group_id="g", env="e", tag="t", group_size=1).message_id() == "task:g"


def _encoded(kind=TaskSpec):
    message = next(m for m in sample_messages() if isinstance(m, kind))
    return DEFAULT_CODEC.encode(message, job="j")


def test_unknown_major_version_is_rejected():
    headers, value = _encoded()
    with pytest.raises(MessageDecodeError) as err:
        DEFAULT_CODEC.decode(value, _headers(headers, **{H_SCHEMA: "TaskSpec/2.0"}))
    assert err.value.field == H_SCHEMA and "major version 2" in err.value.reason


def test_newer_minor_with_unknown_fields_is_accepted():
    headers, value = _encoded()
    raw = msgpack.unpackb(value)
    raw["field_from_the_future"] = {"nested": [1, 2, 3]}
    envelope = DEFAULT_CODEC.decode(msgpack.packb(raw), _headers(headers, **{H_SCHEMA: "TaskSpec/1.9"}))
    assert envelope.schema == (1, 9)
    assert envelope.message.group_id == "g0"


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda raw: raw.update(group_size="8"), "$.group_size"),
        (lambda raw: raw.pop("tag"), "$.tag"),
        (lambda raw: raw.update(group_size=0), "$.group_size"),
        (lambda raw: raw.update(group_id="x" * 10_000), "$.group_id"),
        (lambda raw: raw.update(labels={"k": 5}), "$.labels"),
        (lambda raw: raw.update(seed=True), "$.seed"),
    ],
    ids=["wrong-type", "missing", "out-of-range", "oversized-string", "wrong-nested-type", "bool-for-int"],
)
def test_invalid_fields_name_the_field(mutate, field):
    headers, value = _encoded()
    raw = msgpack.unpackb(value)
    mutate(raw)
    with pytest.raises(MessageDecodeError) as err:
        DEFAULT_CODEC.decode(msgpack.packb(raw), headers)
    assert err.value.field.startswith(field), err.value


def test_packed_array_of_wrong_length_names_the_field():
    headers, value = _encoded(GenerationRequest)
    raw = msgpack.unpackb(value)
    raw["prompt_ids"] = b"\x01\x02\x03"
    with pytest.raises(MessageDecodeError) as err:
        DEFAULT_CODEC.decode(msgpack.packb(raw), headers)
    assert err.value.field == "$.prompt_ids"


def test_inconsistent_array_lengths_are_rejected():
    headers, value = _encoded(GenerationResult)
    raw = msgpack.unpackb(value)
    raw["logprobs"] = raw["logprobs"][:4]
    with pytest.raises(MessageDecodeError, match="lengths differ"):
        DEFAULT_CODEC.decode(msgpack.packb(raw), headers)


def test_oversized_value_is_rejected_before_decoding():
    codec = Codec(max_value_bytes=2048)
    big = GenerationRequest(traj_id="t", turn=0, group_id="g", tag="x", pool="p",
                            prompt_ids=Int32Array(range(1000)), reply_partition=0)
    with pytest.raises(ValueError, match="limit"):
        codec.encode(big, job="j")
    headers, value = DEFAULT_CODEC.encode(big, job="j")
    with pytest.raises(MessageDecodeError) as err:
        codec.decode(value, headers)
    assert err.value.field == "value" and "exceeds" in err.value.reason


@pytest.mark.parametrize(
    "headers, field",
    [
        ([], "header:rollart-schema"),
        ([(H_SCHEMA, b"TaskSpec")], "header:rollart-schema"),
        ([(H_SCHEMA, b"Nope/1.0")], "rollart-schema"),
        ([(H_SCHEMA, b"TaskSpec/1.0"), ("content-type", b"application/json")], "content-type"),
        ([(H_SCHEMA, b"TaskSpec/1.0"), (H_POLICY_VERSION, b"seven")], "header:rollart-policy-version"),
        ([(H_SCHEMA, b"\xff\xfe")], "header:rollart-schema"),
    ],
    ids=["missing-schema", "no-version", "unknown-kind", "wrong-content-type", "bad-version-header", "not-utf8"],
)
def test_bad_headers_name_the_header(headers, field):
    _, value = _encoded()
    with pytest.raises(MessageDecodeError) as err:
        DEFAULT_CODEC.decode(value, headers)
    assert err.value.field == field


def test_kind_not_accepted_on_topic():
    headers, value = _encoded(TaskSpec)
    with pytest.raises(MessageDecodeError, match="not accepted"):
        DEFAULT_CODEC.decode(value, headers, accept=(GenerationRequest, Abort))


def test_tombstone_and_malformed_msgpack():
    headers, _ = _encoded()
    with pytest.raises(MessageDecodeError, match="tombstone"):
        DEFAULT_CODEC.decode(None, headers)
    with pytest.raises(MessageDecodeError, match="malformed"):
        DEFAULT_CODEC.decode(b"\xc1\xc1", headers)


def test_foreign_headers_are_ignored_and_id_header_wins():
    headers, value = _encoded()
    headers = headers + [("traceparent", b"00-abc"), ("rollart-dlq-error", b"\xff")]
    envelope = DEFAULT_CODEC.decode(value, _headers(headers, **{H_ID: "custom-id", H_JOB: "other"}))
    assert envelope.message_id == "custom-id" and envelope.job == "other"


def test_encode_rejects_unregistered_types():
    with pytest.raises(TypeError):
        DEFAULT_CODEC.encode(object(), job="j")  # type: ignore[arg-type]
