"""The byte format of every parameter-server message: a JSON header and raw tensor buffers.

Why not pickle: bytes that arrive over the network must never choose what code runs, and unpickling
does exactly that. Why not protobuf: the payload is a handful of large flat buffers, and a hand-made
frame keeps them zero-parse. A frame is::

    b"SPR1" | header length (u32, little-endian) | header (UTF-8 JSON) | tensor bytes, back to back

The header is ``{"meta": {...}, "tensors": [{"name", "dtype", "shape"}, ...]}``: ``meta`` carries
plain JSON values (the operation's arguments), ``dtype`` is a small integer code (never a type name
to look up), and ``shape`` a list of non-negative integers. :func:`decode` checks every declared size
against the limits and against the bytes actually received *before* it allocates anything, so a
frame that declares 10 GiB costs nothing but its own length.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from spread.errors import WireFormatError

MAGIC = b"SPR1"
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 4 * 1024 * 1024
"""A header larger than this is refused (it holds names and shapes, never data)."""
DEFAULT_MAX_FRAME_BYTES = 1 << 30
"""Default limit on one frame (1 GiB); larger transfers are split by the client."""
MAX_DIMS = 8

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.uint8: 7,
    torch.int8: 8,
    torch.int16: 9,
    torch.bool: 10,
}
CODE_DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}

Tensors = dict[str, torch.Tensor]


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is already a contiguous CPU tensor."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy().data)


def encode_parts(
    meta: Mapping[str, Any] | None = None, tensors: Mapping[str, torch.Tensor] | None = None
) -> list[bytes | memoryview]:
    """One frame as a list of buffers (prefix and header, then each tensor's bytes, not copied)."""
    entries, buffers = [], []
    for name, tensor in (tensors or {}).items():
        if tensor.dtype not in DTYPE_CODES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which the wire format cannot carry")
        entries.append({"name": name, "dtype": DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape)})
        buffers.append(_raw(tensor))
    header = json.dumps({"meta": dict(meta or {}), "tensors": entries}, separators=(",", ":")).encode()
    header += b" " * (-(len(header) + _PREFIX.size) % 8)  # tensors start 8-byte aligned
    return [_PREFIX.pack(MAGIC, len(header)) + header, *buffers]


def encode(meta: Mapping[str, Any] | None = None, tensors: Mapping[str, torch.Tensor] | None = None) -> bytes:
    """One frame holding ``meta`` (JSON values) and ``tensors`` (any device; sent as CPU bytes)."""
    return b"".join(encode_parts(meta, tensors))


def header_part(frame: bytes | bytearray | memoryview) -> memoryview:
    """The frame's prefix and header (names, dtypes, shapes and meta: what an RPC session's MAC
    covers); the whole buffer when it is too short to hold the header it declares."""
    view = memoryview(frame).cast("B")
    if view.nbytes >= _PREFIX.size:
        end = _PREFIX.size + _PREFIX.unpack_from(view, 0)[1]
        if end <= view.nbytes:
            return view[:end]
    return view


def _fail(problem: str) -> WireFormatError:
    return WireFormatError(f"malformed frame: {problem}")


def _check_entry(entry: object, index: int, max_tensor_bytes: int) -> tuple[str, torch.dtype, list[int], int]:
    if not isinstance(entry, dict):
        raise _fail(f"tensor entry {index} is not an object")
    name, code, shape = entry.get("name"), entry.get("dtype"), entry.get("shape")
    if not isinstance(name, str):
        raise _fail(f"tensor entry {index} has no string name")
    if not isinstance(code, int) or isinstance(code, bool) or code not in CODE_DTYPES:
        raise _fail(f"tensor {name!r} has unknown dtype code {code!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise _fail(f"tensor {name!r} has an invalid shape {shape!r}")
    dtype = CODE_DTYPES[code]
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize  # Python ints: no overflow, however large the claim
    if nbytes > max_tensor_bytes:
        raise _fail(f"tensor {name!r} declares {nbytes} bytes, over the limit of {max_tensor_bytes}")
    return name, dtype, shape, nbytes


def _parse_header(
    frame: bytes | bytearray | memoryview, frame_len: int, max_tensor_bytes: int
) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, list[int], int]], int]:
    """``(header, checked tensor entries, offset of the first tensor byte)`` of a frame of
    ``frame_len`` bytes whose first bytes are ``frame``."""
    if len(frame) < _PREFIX.size:
        raise _fail(f"{frame_len} bytes is shorter than the frame prefix")
    magic, header_len = _PREFIX.unpack_from(frame, 0)
    if magic != MAGIC:
        raise _fail(f"bad magic {magic!r} (expected {MAGIC!r})")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > min(len(frame), frame_len):
        raise _fail(f"header length {header_len} does not fit the {frame_len}-byte frame")
    try:
        header = json.loads(bytes(frame[_PREFIX.size : _PREFIX.size + header_len]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _fail(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("meta"), dict):
        raise _fail("header must be an object with a 'meta' object")
    entries = header.get("tensors")
    if not isinstance(entries, list):
        raise _fail("header must list its tensors")
    checked = [_check_entry(e, i, max_tensor_bytes) for i, e in enumerate(entries)]
    offset = _PREFIX.size + header_len
    declared = sum(nbytes for *_, nbytes in checked)
    if declared != frame_len - offset:
        raise _fail(f"tensors declare {declared} bytes but {frame_len - offset} follow the header")
    if len({name for name, *_ in checked}) != len(checked):
        raise _fail("duplicate tensor names")
    return header, checked, offset


def decode_parts(
    parts: list[memoryview], *, max_tensor_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> tuple[dict[str, Any], Tensors] | None:
    """As :func:`decode`, for a frame that arrived as :func:`encode_parts` sent it (prefix and header
    in the first part, then exactly one part per tensor): each tensor views its part's memory (no
    copy) when the part is writable and aligned for its dtype, else is copied. Returns None when the
    parts are not laid out so (the caller joins them and calls :func:`decode`); raises
    :class:`WireFormatError` on a malformed frame, validated as :func:`decode` does."""
    if not parts or parts[0].nbytes < _PREFIX.size:
        return None
    if _PREFIX.size + _PREFIX.unpack_from(parts[0], 0)[1] > parts[0].nbytes:
        return None  # the header does not end with the first part
    total = sum(p.nbytes for p in parts)
    header, checked, offset = _parse_header(parts[0], total, max_tensor_bytes)
    if offset != parts[0].nbytes or len(parts) != len(checked) + 1:
        return None
    if any(part.nbytes != nbytes for part, (*_, nbytes) in zip(parts[1:], checked, strict=True)):
        return None
    tensors: Tensors = {}
    for part, (name, dtype, shape, nbytes) in zip(parts[1:], checked, strict=True):
        flat = np.frombuffer(part, dtype=np.uint8) if nbytes else None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if flat is not None and not part.readonly and flat.ctypes.data % max(itemsize, 1) == 0:
            out = torch.frombuffer(part, dtype=torch.uint8).view(dtype).reshape(shape)
        else:
            out = torch.empty(shape, dtype=dtype)
            if flat is not None:
                out.reshape(-1).view(torch.uint8).numpy()[:] = flat
        tensors[name] = out
    return header["meta"], tensors


def decode(
    frame: bytes | bytearray | memoryview, *, max_tensor_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> tuple[dict[str, Any], Tensors]:
    """Parse a frame into ``(meta, tensors)``; raise :class:`WireFormatError` on anything malformed.

    Validation happens before any tensor is allocated: the magic, the header length, the JSON, each
    dtype code and shape, each declared size against ``max_tensor_bytes``, and the sum of declared
    sizes against the bytes that actually follow the header (they must match exactly).
    """
    header, checked, offset = _parse_header(frame, len(frame), max_tensor_bytes)
    tensors: Tensors = {}
    # A writable frame (a bytearray the transport received into) is used in place: no copy.
    writable = isinstance(frame, bytearray)
    for name, dtype, shape, nbytes in checked:
        if writable and nbytes and offset % 8 == 0:
            raw = torch.frombuffer(frame, dtype=torch.uint8, count=nbytes, offset=offset)
            out = raw.view(dtype).reshape(shape)
        else:
            out = torch.empty(shape, dtype=dtype)
            if nbytes:
                out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(
                    frame, dtype=np.uint8, count=nbytes, offset=offset
                )
        tensors[name] = out
        offset += nbytes
    return header["meta"], tensors
