"""Wire frames: round trips, and malformed frames refused before anything is allocated (S5)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from spread.errors import WireFormatError
from spread.ps.wire import MAGIC, decode, decode_parts, encode, encode_parts


def _frame(entries: list, payload: bytes = b"", meta: dict | None = None) -> bytes:
    header = json.dumps({"meta": meta or {}, "tensors": entries}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.arange(7, dtype=torch.int64),
        torch.randn(5).to(torch.bfloat16),
        torch.tensor(True),
        torch.empty(0, 3),
        torch.randn(2, 3).t(),  # non-contiguous
    ],
)
def test_round_trip_is_exact(tensor):
    meta, tensors = decode(encode({"op": "x", "n": [1, 2]}, {"t": tensor}))
    assert meta == {"op": "x", "n": [1, 2]}
    assert tensors["t"].dtype == tensor.dtype
    assert torch.equal(tensors["t"], tensor)


def test_round_trip_in_place_from_a_bytearray():
    a, b = torch.randn(1000), torch.arange(3, dtype=torch.int8)
    _, tensors = decode(bytearray(encode({}, {"b": b, "a": a})))
    assert torch.equal(tensors["a"], a) and torch.equal(tensors["b"], b)


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (_frame([{"name": "x", "dtype": 99, "shape": [2]}], b"\0" * 8), "unknown dtype code"),
        (_frame([{"name": "x", "dtype": 1, "shape": [3]}], b"\0" * 8), "declare 12 bytes but 8"),
        (_frame([{"name": "x", "dtype": 1, "shape": [2, -1]}], b""), "invalid shape"),
        (_frame([{"name": "x", "dtype": 1, "shape": [1 << 30, 10]}], b"\0" * 8), "over the limit"),
        (_frame([{"name": "x", "dtype": "float32", "shape": [2]}], b"\0" * 8), "unknown dtype code"),
        (b"XXXX" + b"\0" * 8, "bad magic"),
        (MAGIC + struct.pack("<I", 1 << 31), "does not fit"),
        (MAGIC + struct.pack("<I", 3) + b"{{{", "not JSON"),
        (_frame([{"name": "x", "dtype": 1, "shape": [1]}] * 2, b"\0" * 8), "duplicate"),
    ],
)
def test_malformed_frames_are_refused(frame, problem):
    with pytest.raises(WireFormatError, match=problem):
        decode(frame)


def test_ten_gib_claim_allocates_nothing():
    frame = _frame([{"name": "x", "dtype": 1, "shape": [10 * (1 << 30) // 4]}], b"\0" * 16)
    with pytest.raises(WireFormatError, match="over the limit"):
        decode(frame)
    with pytest.raises(WireFormatError, match="but 16 follow"):
        decode(frame, max_tensor_bytes=1 << 40)


def _received(tensors: dict, *, make=bytearray) -> list[memoryview]:
    """The parts of a frame as a transport hands them over (each in its own buffer)."""
    return [memoryview(make(bytes(p))) for p in encode_parts({"op": "push"}, tensors)]


def test_decode_parts_views_each_received_part_without_a_copy():
    a, rows = torch.randn(100, 4), torch.arange(7, dtype=torch.int64)
    parts = _received({"a": a, "rows": rows, "empty": torch.empty(0, 3)})
    meta, tensors = decode_parts(parts)
    assert meta == {"op": "push"}
    assert torch.equal(tensors["a"], a) and torch.equal(tensors["rows"], rows)
    assert tensors["empty"].shape == (0, 3)
    address = torch.frombuffer(parts[1], dtype=torch.uint8).data_ptr()
    assert tensors["a"].data_ptr() == address  # a view of the received bytes, not a copy


def test_decode_parts_copies_read_only_or_misaligned_parts():
    a = torch.randn(9)
    _, tensors = decode_parts(_received({"a": a}, make=bytes))  # read-only: copied
    assert torch.equal(tensors["a"], a)
    header, body = encode_parts({}, {"a": a})
    shifted = memoryview(bytearray(1 + len(bytes(body))))[1:]  # starts 1 byte past an aligned address
    shifted[:] = bytes(body)
    _, tensors = decode_parts([memoryview(bytearray(header)), shifted])
    assert torch.equal(tensors["a"], a)
    assert tensors["a"].data_ptr() != torch.frombuffer(shifted, dtype=torch.uint8).data_ptr()


def test_decode_parts_leaves_other_layouts_to_decode():
    frame = encode({}, {"a": torch.randn(4), "b": torch.randn(2)})
    assert decode_parts([memoryview(bytearray(frame))]) is None  # one part for everything
    parts = _received({"a": torch.randn(4), "b": torch.randn(2)})
    assert decode_parts([parts[0], memoryview(bytearray(bytes(parts[1]) + bytes(parts[2])))]) is None
    assert decode_parts([memoryview(bytearray(frame[:5])), memoryview(bytearray(frame[5:]))]) is None


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (_frame([{"name": "x", "dtype": 99, "shape": [2]}]), "unknown dtype code"),
        (_frame([{"name": "x", "dtype": 1, "shape": [3]}]), "declare 12 bytes but 8"),
        (_frame([{"name": "x", "dtype": 1, "shape": [1 << 30, 10]}]), "over the limit"),
        (b"XXXX" + b"\0" * 8, "bad magic"),
        (_frame([{"name": "x", "dtype": 1, "shape": [1]}] * 2), "duplicate"),
    ],
)
def test_decode_parts_refuses_malformed_frames(frame, problem):
    with pytest.raises(WireFormatError, match=problem):
        decode_parts([memoryview(bytearray(frame)), memoryview(bytearray(8))])
