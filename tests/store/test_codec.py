"""The codec: plain types <-> protobuf, and the hand-encoded chunk response equals protobuf's."""

from __future__ import annotations

import pytest

from lorastream.adapter_store.v1 import adapter_store_pb2 as pb
from lorastream.core import codec, worker_codec
from lorastream.core.checksum import crc32c
from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import SamplingParams
from lorastream.core.manifest import AdapterManifest, TensorChunk, TensorInfo
from lorastream.gpu_worker.v1 import gpu_worker_pb2 as worker_pb2


@pytest.mark.parametrize(
    ("tensor_index", "offset", "data"),
    [
        (0, 0, b"x"),  # proto3 defaults omitted
        (3, 0, b"ab"),
        (0, 5, b""),  # empty data omitted
        (127, 128, b"\x00" * 127),  # varint boundaries
        (128, 16383, b"\xff" * 128),
        (2**31 - 1, 2**40 + 7, bytes(range(256)) * 4096),  # a 1 MiB payload, a huge offset
    ],
)
def test_encoded_chunk_response_is_byte_identical_to_protobuf(
    tensor_index: int, offset: int, data: bytes
) -> None:
    chunk = TensorChunk(tensor_index, offset, data, crc32c(data))
    encoded = codec.encode_chunk_response(chunk)
    assert encoded == codec.chunk_to_pb(chunk).SerializeToString(deterministic=True)
    parsed = pb.StreamAdapterTensorsResponse.FromString(encoded)
    assert parsed.WhichOneof("payload") == "chunk"
    assert codec.chunk_from_pb(parsed.chunk) == chunk
    decoded = codec.decode_stream_response(encoded)
    assert decoded == chunk and bytes(decoded.data) == data


def test_decoder_skips_unknown_fields_and_takes_fields_in_any_order() -> None:
    # TensorChunk{crc32c=9, unknown 15 (varint), data="hi", unknown 14 (fixed32), offset=300,
    # tensor_index=2}: out of order and with fields a newer server might add.
    inner = bytes([0x20, 9, 0x78, 1, 0x1A, 2]) + b"hi" + bytes([0x75, 1, 2, 3, 4])
    inner += bytes([0x10, 0xAC, 0x02, 0x08, 2])
    raw = bytes([0x12, len(inner)]) + inner
    expected = pb.StreamAdapterTensorsResponse.FromString(raw).chunk
    decoded = codec.decode_stream_response(raw)
    assert (decoded.tensor_index, decoded.offset, bytes(decoded.data), decoded.crc32c) == (
        expected.tensor_index, expected.offset, expected.data, expected.crc32c
    ) == (2, 300, b"hi", 9)


def test_decoder_reads_the_manifest_through_protobuf() -> None:
    manifest = _manifest()
    raw = pb.StreamAdapterTensorsResponse(manifest=codec.manifest_to_pb(manifest))
    assert codec.decode_stream_response(raw.SerializeToString()) == manifest


@pytest.mark.parametrize(
    "raw",
    [b"", bytes([0x12, 5, 0x08]), bytes([0x12, 0x80]), bytes([0x13, 0x00])],
    ids=["empty", "truncated-payload", "truncated-varint", "group-wire-type"],
)
def test_decoder_refuses_malformed_responses(raw: bytes) -> None:
    with pytest.raises(ValueError):
        codec.decode_stream_response(raw)


def test_encoding_refuses_negative_fields() -> None:
    with pytest.raises(ValueError):
        codec.encode_chunk_response(TensorChunk(-1, 0, b"a", 1))


def _manifest() -> AdapterManifest:
    return AdapterManifest(
        adapter_id="ab" * 32,
        name="org/adapter-1",
        source_uri="s3://bucket/a",
        revision="etag@v1",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        rank=16,
        alpha=32.0,
        use_rslora=True,
        target_modules=("q_proj", "v_proj"),
        tensors=(TensorInfo("t.lora_A.weight", "BF16", (16, 576), 18432, "00" * 32),),
        created_at=1.5,
        pinned=True,
        last_used_at=2.5,
    )


@pytest.mark.parametrize("invocation", [(), (17, 44, 45)], ids=["lora", "activated-lora"])
def test_manifest_round_trips_through_protobuf(invocation: tuple[int, ...]) -> None:
    manifest = _manifest().replace(alora_invocation_tokens=invocation)
    assert codec.manifest_from_pb(codec.manifest_to_pb(manifest)) == manifest


@pytest.mark.parametrize(
    ("max_tokens", "on_the_wire", "decoded"),
    [(0, None, 0), (1, 1, 1), (300, 300, 300)],
    ids=["default-is-unset", "one", "many"],
)
def test_max_tokens_travels_with_presence(
    max_tokens: int, on_the_wire: int | None, decoded: int
) -> None:
    msg = worker_codec.sampling_to_pb(SamplingParams(max_tokens=max_tokens))
    assert (msg.max_tokens if msg.HasField("max_tokens") else None) == on_the_wire
    assert worker_codec.sampling_from_pb(msg).max_tokens == decoded


@pytest.mark.parametrize("value", [0, -5])
def test_an_explicit_max_tokens_below_1_is_refused(value: int) -> None:
    msg = worker_pb2.SamplingParams(max_tokens=value)
    with pytest.raises(InvalidArgument, match="max_tokens must be >= 1"):
        worker_codec.sampling_from_pb(msg)
