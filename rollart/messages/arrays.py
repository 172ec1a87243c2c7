"""Packed numeric arrays carried inside messages.

Token ids, logprobs, per-token policy versions and loss masks travel as msgpack ``bin`` values
holding little-endian packed numbers, never as lists of Python ints: a 32k-token context is one
128 KiB byte string that decodes with a single ``frombytes``. In memory they are ``array.array``
subclasses, so they compare by value, cost 4 bytes per element and hand their buffer to numpy or
torch without a copy (``np.frombuffer(arr, dtype=...)``).
"""

from __future__ import annotations

import array
import sys
from typing import Any, ClassVar, Iterable

# Hard cap on elements in one array (16M): far above any context length, far below memory trouble.
MAX_ARRAY_ELEMENTS = 1 << 24

_BIG_ENDIAN = sys.byteorder == "big"


class PackedArray(array.array):  # type: ignore[type-arg]  # the typecode is fixed per subclass
    """Base for the typed packed arrays; subclasses fix the element type."""

    TYPECODE: ClassVar[str]

    def __new__(cls, data: Iterable[Any] = ()) -> "PackedArray":  # noqa: D102 - array.array signature, typecode fixed
        return super().__new__(cls, cls.TYPECODE, data)

    def to_wire(self) -> bytes:
        if _BIG_ENDIAN:  # pragma: no cover - the wire format is little-endian everywhere
            swapped = array.array(self.typecode, self)
            swapped.byteswap()
            return swapped.tobytes()
        return self.tobytes()

    @classmethod
    def from_wire(cls, raw: object) -> "PackedArray":
        """Build from wire bytes; raises TypeError/ValueError that the codec turns into a field error."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise TypeError(f"expected packed bytes, got {type(raw).__name__}")
        out = cls()
        if len(raw) % out.itemsize:
            raise ValueError(f"packed length {len(raw)} is not a multiple of {out.itemsize}")
        if len(raw) // out.itemsize > MAX_ARRAY_ELEMENTS:
            raise ValueError(f"array of {len(raw) // out.itemsize} elements exceeds {MAX_ARRAY_ELEMENTS}")
        out.frombytes(raw)
        if _BIG_ENDIAN:  # pragma: no cover
            out.byteswap()
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"

    # array.array's own copy hooks return a plain array; keep the subclass (and its type check).
    def __copy__(self) -> "PackedArray":
        return type(self)(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> "PackedArray":
        return type(self)(self)


class Int32Array(PackedArray):
    """Token ids, per-token policy versions."""

    TYPECODE = "i"


class Float32Array(PackedArray):
    """Per-token logprobs."""

    TYPECODE = "f"


class UInt8Array(PackedArray):
    """Loss masks (1 = LLM token that is trained on, 0 = prompt or environment token)."""

    TYPECODE = "B"


PACKED_TYPES: tuple[type[PackedArray], ...] = (Int32Array, Float32Array, UInt8Array)
