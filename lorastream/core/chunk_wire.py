"""The chunk response of ``StreamAdapterTensors`` as raw protobuf bytes, without the runtime.

Part of the codec: :mod:`lorastream.core.codec` re-exports :func:`encode_chunk_response` and
:func:`serialize_response` and decodes with :func:`fields`; kept apart because it works on wire
bytes rather than on generated messages.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import Message

from lorastream.core.manifest import TensorChunk

# -- the chunk response on the wire ---------------------------------------------------------
# A chunk is ``StreamAdapterTensorsResponse{chunk (2): TensorChunk{tensor_index (1),
# offset (2), data (3), crc32c (4)}}``. Building that message through the Python protobuf runtime
# copies the (1 MiB) payload twice and is the slowest step of a stream (more than gRPC's own
# cost; docs/notes/store.md, "Costs moved from the stream's comments"), so the servicer sends these
# bytes instead: the same encoding protobuf produces (tests/store/test_codec.py compares them byte
# for byte), with one copy of the payload. Example, tensor 3, offset 0, data b"ab", crc 5:
#   12 08 | 08 03 | 1a 02 61 62 | 20 05       (offset 0 is proto3's default: omitted)
_WIRE_VARINT, _WIRE_LEN = 0, 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def encode_chunk_response(chunk: TensorChunk) -> bytes:
    """``chunk_to_pb(chunk).SerializeToString()``, without the protobuf runtime's copies."""
    if chunk.tensor_index < 0 or chunk.offset < 0 or not 0 <= chunk.crc32c < 1 << 32:
        raise ValueError(f"chunk fields out of range: {chunk.tensor_index}, {chunk.offset}")
    head = bytearray()
    if chunk.tensor_index:
        head += _tag(1, _WIRE_VARINT) + _varint(chunk.tensor_index)
    if chunk.offset:
        head += _tag(2, _WIRE_VARINT) + _varint(chunk.offset)
    size = len(chunk.data)
    if size:
        head += _tag(3, _WIRE_LEN) + _varint(size)
    tail = _tag(4, _WIRE_VARINT) + _varint(chunk.crc32c) if chunk.crc32c else b""
    outer = _tag(2, _WIRE_LEN) + _varint(len(head) + size + len(tail))
    return b"".join((outer, head, chunk.data, tail))


def _read_varint(raw: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(raw: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) pairs of one message: ints for varints, views for LEN fields.

    Fixed-width fields are skipped (the chunk message has none); group wire types are refused.
    """
    pos = 0
    while pos < len(raw):
        key, pos = _read_varint(raw, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _WIRE_VARINT:
            value, pos = _read_varint(raw, pos)
            yield field, value
        elif wire_type == _WIRE_LEN:
            size, pos = _read_varint(raw, pos)
            if pos + size > len(raw):
                raise ValueError("length-delimited field runs past the message")
            yield field, raw[pos : pos + size]
            pos += size
        elif wire_type in (1, 5):  # fixed64 / fixed32: unknown here, skipped
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
    if pos != len(raw):
        raise ValueError("field runs past the message")


def serialize_response(message: bytes | Message) -> bytes:
    """Response serializer for servicers that may yield pre-encoded bytes."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()
