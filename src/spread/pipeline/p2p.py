"""Point-to-point transfers between neighbouring stages: activations forward, gradients back.

Activations carry a small fixed header first (dtype, whether a gradient will come back, shape), so
micro-batches may differ in size and stages need not know each other's output shapes. Gradients
need no header: they have the shape of the activation they belong to, which both sides know.

Sends are non-blocking (``isend``): the stage goes on computing while the message travels, and
:meth:`StageLink.wait_sends` completes them at the end of a step. Receives block, with the process
group's deadline. Every failure becomes a :class:`~spread.errors.CollectiveError` naming this rank,
the operation (``recv_act[mb 3]``), its sequence number and the peer rank.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from spread.comm.ops import classify_error
from spread.errors import CollectiveError

HEADER_LEN = 8  # dtype code, requires_grad, ndim, up to 5 dims
MAX_DIMS = HEADER_LEN - 3
DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


def encode_header(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    if tensor.dtype not in _CODE:
        raise TypeError(f"cannot send a {tensor.dtype} activation between stages; supported: {DTYPES}")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(
            f"activations between stages may have at most {MAX_DIMS} dimensions, got {tensor.dim()}"
        )
    header = [_CODE[tensor.dtype], int(requires_grad), tensor.dim(), *tensor.shape]
    return torch.tensor(header + [0] * (HEADER_LEN - len(header)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[torch.dtype, bool, tuple[int, ...]]:
    values = header.tolist()
    code, requires_grad, ndim = values[0], values[1], values[2]
    if not 0 <= code < len(DTYPES) or not 0 <= ndim <= MAX_DIMS or any(d < 0 for d in values[3 : 3 + ndim]):
        raise ValueError(f"malformed activation header {values}")
    return DTYPES[code], bool(requires_grad), tuple(values[3 : 3 + ndim])


class StageLink:
    """This stage's connections to the previous and next stage (global ranks; None at the ends)."""

    def __init__(
        self,
        rank: int,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank, self.prev_rank, self.next_rank = rank, prev_rank, next_rank
        self.device = device
        self.group = group
        # NCCL moves only device tensors; gloo moves CPU tensors (and CUDA tensors through a copy).
        self._header_device = device if device.type == "cuda" else torch.device("cpu")
        self._seq = itertools.count()
        self._sends: list[tuple[dist.Work, torch.Tensor, str, int, int]] = []

    def _fail(self, op: str, seq: int, peer: int, exc: BaseException) -> CollectiveError:
        err = classify_error(self.rank, op, seq, exc)
        return type(err)(self.rank, op, seq, err.detail, peer=peer)

    def _isend(self, tensor: torch.Tensor, peer: int, op: str) -> None:
        seq = next(self._seq)
        try:
            work = dist.isend(tensor, dst=peer, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail(op, seq, peer, exc) from exc
        self._sends.append((work, tensor, op, seq, peer))

    def _recv(self, tensor: torch.Tensor, peer: int, op: str) -> torch.Tensor:
        seq = next(self._seq)
        try:
            dist.recv(tensor, src=peer, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail(op, seq, peer, exc) from exc
        return tensor

    # -- activations (forward direction) ---------------------------------------------------------
    def send_activation(self, tensor: torch.Tensor, microbatch: int) -> None:
        assert self.next_rank is not None, "the last stage sends no activations"
        data = tensor.detach().contiguous()
        self._isend(
            encode_header(data, tensor.requires_grad).to(self._header_device),
            self.next_rank,
            f"send_act_header[mb {microbatch}]",
        )
        self._isend(data, self.next_rank, f"send_act[mb {microbatch}]")

    def recv_activation(self, microbatch: int) -> tuple[torch.Tensor, bool]:
        """The next activation from the previous stage, and whether it wants a gradient back."""
        assert self.prev_rank is not None, "the first stage receives no activations"
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._header_device)
        self._recv(header, self.prev_rank, f"recv_act_header[mb {microbatch}]")
        dtype, requires_grad, shape = decode_header(header.cpu())
        data = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv(data, self.prev_rank, f"recv_act[mb {microbatch}]")
        return data, requires_grad

    # -- gradients (backward direction) ----------------------------------------------------------
    def send_grad(self, grad: torch.Tensor, microbatch: int) -> None:
        assert self.prev_rank is not None, "the first stage sends no gradients"
        self._isend(grad.detach().contiguous(), self.prev_rank, f"send_grad[mb {microbatch}]")

    def recv_grad(self, like: torch.Tensor, microbatch: int) -> torch.Tensor:
        assert self.next_rank is not None, "the last stage receives no gradients"
        grad = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        return self._recv(grad, self.next_rank, f"recv_grad[mb {microbatch}]")

    def wait_sends(self) -> None:
        """Complete every send started so far (their buffers may be reused afterwards)."""
        sends, self._sends = self._sends, []
        for work, _tensor, op, seq, peer in sends:
            try:
                work.wait()
            except (RuntimeError, dist.DistError) as exc:
                raise self._fail(op, seq, peer, exc) from exc
