"""The one codec: message <-> (Kafka headers, msgpack value).

Headers carry the envelope (ARCHITECTURE.md, "Message envelope"):

* ``rollart-schema``: ``<kind>/<major>.<minor>``
* ``content-type``: ``application/msgpack``
* ``rollart-id``: the message's deterministic id (de-duplication)
* ``rollart-job``: the job that produced it
* ``rollart-policy-version``: the policy version the message belongs to (or is produced under)

Decoding is strict: every failure (bad headers, unknown kind, unknown major version, malformed
msgpack, wrong type, missing field, oversized value) raises :class:`MessageDecodeError`, which names
the field. Unknown fields of a newer minor version are ignored. Nothing is ever pickled or eval'd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgspec

from rollart.messages.arrays import PACKED_TYPES, PackedArray
from rollart.messages.kinds import MESSAGE_KINDS

CONTENT_TYPE = "application/msgpack"
H_SCHEMA = "rollart-schema"
H_CONTENT_TYPE = "content-type"
H_ID = "rollart-id"
H_JOB = "rollart-job"
H_POLICY_VERSION = "rollart-policy-version"

ENVELOPE_HEADERS = frozenset({H_SCHEMA, H_CONTENT_TYPE, H_ID, H_JOB, H_POLICY_VERSION})

DEFAULT_MAX_VALUE_BYTES = 32 << 20  # 32 MiB; weights never travel on the bus, only manifests
MAX_HEADER_BYTES = 1024

Headers = list[tuple[str, bytes]]


class MessageDecodeError(ValueError):
    """A message could not be decoded; ``field`` names what was wrong (a header or ``$.path``)."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded message with its envelope metadata."""

    kind: str
    schema: tuple[int, int]
    message_id: str
    job: str
    policy_version: int | None
    message: Any


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, PackedArray):
        return obj.to_wire()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind in PACKED_TYPES:
        return kind.from_wire(obj)
    raise NotImplementedError(f"cannot decode into {kind!r}")


def _field_of(error: msgspec.ValidationError) -> str:
    # msgspec appends " - at `$.path`" to errors located in the document.
    text = str(error)
    marker = " - at `"
    if marker in text:
        return text.rsplit(marker, 1)[1].rstrip("`")
    if "missing required field `" in text:
        return "$." + text.split("missing required field `", 1)[1].rstrip("`")
    return "$"


class Codec:
    """Encodes and decodes every registered message kind.

    One instance per process is enough; it is immutable after construction and thread-safe.
    """

    def __init__(self, kinds: Iterable[type] = MESSAGE_KINDS, *, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES):
        self.max_value_bytes = max_value_bytes
        self._kinds: dict[str, Any] = {k.KIND: k for k in kinds}  # type: ignore[attr-defined]  # every kind has KIND
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {
            name: msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook) for name, kind in self._kinds.items()
        }

    @property
    def kinds(self) -> dict[str, type]:
        return dict(self._kinds)

    # -- encoding -------------------------------------------------------------------------------

    def encode_value(self, message: Any) -> bytes:
        return self._encoder.encode(message)

    def schema(self, message: Any) -> bytes:
        """The message's ``rollart-schema`` header value (its kind and version)."""
        kind: Any = self._kinds.get(getattr(type(message), "KIND", ""))
        if kind is None or kind is not type(message):
            raise TypeError(f"{type(message).__name__} is not a registered message kind")
        major, minor = kind.SCHEMA
        return f"{kind.KIND}/{major}.{minor}".encode()

    def headers(self, message: Any, *, job: str, policy_version: int | None = None) -> Headers:
        headers: Headers = [
            (H_SCHEMA, self.schema(message)),
            (H_CONTENT_TYPE, CONTENT_TYPE.encode()),
            (H_ID, message.message_id().encode()),
            (H_JOB, job.encode()),
        ]
        if policy_version is not None:
            headers.append((H_POLICY_VERSION, str(int(policy_version)).encode()))
        return headers

    def encode(self, message: Any, *, job: str, policy_version: int | None = None) -> tuple[Headers, bytes]:
        headers = self.headers(message, job=job, policy_version=policy_version)  # rejects unregistered types
        value = self.encode_value(message)
        if len(value) > self.max_value_bytes:
            raise ValueError(f"{type(message).__name__} encodes to {len(value)} bytes > limit {self.max_value_bytes}")
        return headers, value

    # -- decoding -------------------------------------------------------------------------------

    def decode(
        self,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None,
        *,
        accept: Iterable[type] | None = None,
    ) -> Envelope:
        """Decode one record. ``accept`` restricts the kinds valid on this topic."""
        meta = _header_map(headers)
        kind_name, major, minor = _parse_schema(meta.get(H_SCHEMA))
        kind = self._kinds.get(kind_name)
        if kind is None:
            raise MessageDecodeError(H_SCHEMA, f"unknown message kind {kind_name!r}")
        if accept is not None and kind not in tuple(accept):
            raise MessageDecodeError(H_SCHEMA, f"kind {kind_name} is not accepted on this topic")
        if major != kind.SCHEMA[0]:
            raise MessageDecodeError(
                H_SCHEMA, f"unsupported major version {major} of {kind_name} (this reader knows {kind.SCHEMA[0]})"
            )
        content_type = meta.get(H_CONTENT_TYPE, CONTENT_TYPE)
        if content_type != CONTENT_TYPE:
            raise MessageDecodeError(H_CONTENT_TYPE, f"expected {CONTENT_TYPE}, got {content_type!r}")
        message = self._decode_value(kind_name, value)
        return Envelope(
            kind=kind_name,
            schema=(major, minor),
            message_id=meta.get(H_ID) or message.message_id(),
            job=meta.get(H_JOB, ""),
            policy_version=_parse_int(H_POLICY_VERSION, meta.get(H_POLICY_VERSION)),
            message=message,
        )

    def _decode_value(self, kind_name: str, value: bytes | None) -> Any:
        if value is None:
            raise MessageDecodeError("value", "record has no value (tombstone)")
        if len(value) > self.max_value_bytes:
            raise MessageDecodeError("value", f"{len(value)} bytes exceeds the limit of {self.max_value_bytes}")
        try:
            return self._decoders[kind_name].decode(value)
        except msgspec.ValidationError as exc:
            raise MessageDecodeError(_field_of(exc), str(exc).split(" - at `")[0]) from None
        except msgspec.DecodeError as exc:
            raise MessageDecodeError("value", f"malformed msgpack: {exc}") from None
        except (ValueError, TypeError, RecursionError) as exc:  # pragma: no cover - defensive
            raise MessageDecodeError("value", f"{type(exc).__name__}: {exc}") from None


def _header_map(headers: Sequence[tuple[str, bytes]] | None) -> dict[str, str]:
    meta: dict[str, str] = {}
    for name, raw in headers or ():
        if name not in ENVELOPE_HEADERS:
            continue  # foreign headers (tracing, DLQ provenance, ...) pass through untouched
        if raw is None or len(raw) > MAX_HEADER_BYTES:
            raise MessageDecodeError(f"header:{name}", "missing or oversized header value")
        try:
            meta[name] = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise MessageDecodeError(f"header:{name}", "not valid UTF-8") from None
    return meta


def _parse_schema(raw: str | None) -> tuple[str, int, int]:
    if not raw:
        raise MessageDecodeError(f"header:{H_SCHEMA}", "missing schema header")
    kind, sep, version = raw.partition("/")
    major_s, dot, minor_s = version.partition(".")
    if not (sep and dot and kind and major_s.isdigit() and minor_s.isdigit()):
        raise MessageDecodeError(f"header:{H_SCHEMA}", f"expected '<kind>/<major>.<minor>', got {raw!r}")
    return kind, int(major_s), int(minor_s)


def _parse_int(name: str, raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise MessageDecodeError(f"header:{name}", f"not an integer: {raw!r}") from None


DEFAULT_CODEC = Codec()
