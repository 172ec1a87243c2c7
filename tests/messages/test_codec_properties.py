"""Property tests: random, truncated and bit-flipped bytes never crash the decoder.

Whatever the bytes, ``decode`` either returns a message or raises ``MessageDecodeError``; no other
exception type escapes (that is what lets the consumer loop route every bad record to the DLQ).
"""

from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollart.messages import DEFAULT_CODEC, MESSAGE_KINDS, MessageDecodeError
from rollart.messages.samples import sample_messages

ENCODED = [DEFAULT_CODEC.encode(m, job="j", policy_version=1) for m in sample_messages(tokens=12)]
SCHEMA_HEADERS = [h for h, _ in ENCODED]
PROPS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_error(value, headers):
    try:
        return DEFAULT_CODEC.decode(value, headers)
    except MessageDecodeError as exc:
        assert exc.field and exc.reason
        return exc


@PROPS
@given(value=st.binary(max_size=2048), which=st.integers(0, len(MESSAGE_KINDS) - 1))
def test_random_bytes_never_crash(value, which):
    _decode_or_error(value, SCHEMA_HEADERS[which])


@PROPS
@given(which=st.integers(0, len(MESSAGE_KINDS) - 1), data=st.data())
def test_truncated_values_give_the_one_error(which, data):
    headers, value = ENCODED[which]
    cut = data.draw(st.integers(0, len(value) - 1))
    result = _decode_or_error(value[:cut], headers)
    assert isinstance(result, MessageDecodeError)


@PROPS
@given(which=st.integers(0, len(MESSAGE_KINDS) - 1), data=st.data())
def test_bit_flips_never_crash(which, data):
    headers, value = ENCODED[which]
    position = data.draw(st.integers(0, len(value) - 1))
    flipped = bytearray(value)
    flipped[position] ^= 1 << data.draw(st.integers(0, 7))
    _decode_or_error(bytes(flipped), headers)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


@PROPS
@given(which=st.integers(0, len(MESSAGE_KINDS) - 1), value=msgpack_values)
def test_well_formed_msgpack_of_the_wrong_shape_gives_the_one_error(which, value):
    _decode_or_error(msgpack.packb(value), SCHEMA_HEADERS[which])


@PROPS
@given(headers=st.lists(st.tuples(st.sampled_from(["rollart-schema", "rollart-policy-version", "content-type",
                                                     "rollart-id", "x"]), st.binary(max_size=40)), max_size=5))
def test_random_headers_never_crash(headers):
    _decode_or_error(ENCODED[0][1], headers)
