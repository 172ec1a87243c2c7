"""Lossless deltas between two versions of a weight bucket, and the digests that check them.

A bucket's bytes (safetensors: a header, then raw tensors) keep their layout from one version to
the next: the same tensors in the same order with the same shapes (``pack_buckets`` cuts them the
same way each time). Bytewise XOR against the previous version's bucket is therefore zero wherever a
weight did not change, header included, and compresses to little when few weights changed (an RL
step moves few bf16 weights: slime measured ~3% per sync). XOR is exact for every dtype: base XOR
delta is the new bucket bit for bit, NaNs and signed zeros included.
"""

from __future__ import annotations

import hashlib
import lzma
import zlib

import numpy as np

# weights.delta_codec -> BucketDelta.codec. sparse: a bitmap of the XOR's non-zero 8-byte words (1/64
# of the bucket) and those words, nothing compressed: several times less CPU than compressing the
# whole XOR (zlib runs at ~100-300 MB/s, on every byte of every changed bucket), about twice the bytes.
DELTA_CODECS = {"sparse": "xor+sparse", "zlib": "xor+zlib", "lzma": "xor+lzma"}
ZLIB_LEVEL = 1  # deltas are mostly zero bytes: level 1 gets nearly all of it, several times faster than 6
LZMA_PRESET = 1
_HEADER = np.dtype([("length", "<u8"), ("changed", "<u8")])  # of a sparse delta


class DeltaError(ValueError):
    """A delta that cannot be applied: unknown codec, bad compressed data, or the wrong length."""


def bucket_digest(data: bytes) -> str:
    # sha256: with the CPU's SHA instructions (x86 SHA-NI, ARMv8) about twice as fast as blake2b
    return hashlib.sha256(data).hexdigest()


def version_digest(bucket_digests: list[str]) -> str:
    """The whole version's digest: over its buckets' digests in bucket order."""
    h = hashlib.sha256()
    for digest in bucket_digests:
        h.update(bytes.fromhex(digest))
    return h.hexdigest()


def xor_bytes(a: bytes, b: bytes) -> bytes:
    if len(a) != len(b):
        raise DeltaError(f"XOR of {len(a)} and {len(b)} bytes: a delta needs the same bucket layout")
    word = np.uint64 if len(a) % 8 == 0 else np.uint8  # 8 bytes at a time: a few times faster
    return np.bitwise_xor(np.frombuffer(a, word), np.frombuffer(b, word)).tobytes()


def encode_delta(base: bytes, new: bytes, codec: str) -> bytes:
    """``new`` XOR ``base``, encoded by ``codec`` (a key of :data:`DELTA_CODECS`)."""
    if codec == "sparse":
        return _encode_sparse(base, new)
    mixed = xor_bytes(base, new)
    if codec == "lzma":
        return lzma.compress(mixed, preset=LZMA_PRESET)
    return zlib.compress(mixed, ZLIB_LEVEL)


def decode_delta(base: bytes, delta: bytes, codec: str) -> bytes:
    """The new bucket from ``base`` and its ``delta``. Decoding never yields more than ``len(base)``
    bytes, so a corrupt or hostile delta cannot make the reader allocate more than one bucket."""
    if codec == DELTA_CODECS["sparse"]:
        return _decode_sparse(base, delta)
    if codec == DELTA_CODECS["zlib"]:
        decompressor = zlib.decompressobj()
    elif codec == DELTA_CODECS["lzma"]:
        decompressor = lzma.LZMADecompressor()
    else:
        raise DeltaError(f"unknown delta codec {codec!r}")
    try:
        mixed = decompressor.decompress(delta, len(base) + 1)
    except (zlib.error, lzma.LZMAError) as exc:
        raise DeltaError(f"corrupt delta: {exc}") from None
    return xor_bytes(base, mixed)


def _words(data: bytes | bytearray) -> tuple[np.ndarray, bytes]:
    """``data`` as little-endian 8-byte words (writable when ``data`` is a bytearray), and the bytes
    after the last whole word."""
    whole = len(data) - len(data) % 8
    return np.frombuffer(data, "<u8", whole // 8), bytes(data[whole:])


def _encode_sparse(base: bytes, new: bytes) -> bytes:
    """Header, bitmap of the changed words, the changed words XOR-ed, the bytes after the last word XOR-ed."""
    if len(base) != len(new):
        raise DeltaError(f"XOR of {len(base)} and {len(new)} bytes: a delta needs the same bucket layout")
    (old_words, old_tail), (new_words, new_tail) = _words(base), _words(new)
    mixed = np.bitwise_xor(old_words, new_words)
    changed = mixed != 0
    values = mixed[np.flatnonzero(changed)]  # positions, then a gather: faster than a boolean mask
    header = np.array([(len(new), len(values))], _HEADER).tobytes()
    return header + np.packbits(changed).tobytes() + values.tobytes() + xor_bytes(old_tail, new_tail)


def _decode_sparse(base: bytes, delta: bytes) -> bytearray:
    if len(delta) < _HEADER.itemsize:
        raise DeltaError("corrupt delta: shorter than its header")
    length, count = (int(x) for x in np.frombuffer(delta, _HEADER, 1)[0])
    out = bytearray(base)  # the new bucket is built in this one copy of the base
    words, tail = _words(out)
    start = _HEADER.itemsize + (len(words) + 7) // 8
    if length != len(base) or len(delta) != start + 8 * count + len(tail):
        raise DeltaError(f"corrupt delta: sizes do not add up for a bucket of {len(base)} bytes")
    changed = np.unpackbits(np.frombuffer(delta, np.uint8, start - _HEADER.itemsize, _HEADER.itemsize),
                            count=len(words)).view(bool)
    where = np.flatnonzero(changed)
    if len(where) != count:
        raise DeltaError("corrupt delta: the bitmap does not match the count of changed words")
    words[where] ^= np.frombuffer(delta, "<u8", count, start)
    out[len(out) - len(tail):] = xor_bytes(bytes(tail), delta[start + 8 * count:])
    return out
