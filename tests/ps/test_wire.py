"""Wire frames: round trips, and malformed frames refused before anything is allocated (S5)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from spread.errors import WireFormatError
from spread.ps.wire import MAGIC, decode, encode


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
