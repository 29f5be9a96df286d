"""Point-to-point transfers between neighbouring stages: activations forward, gradients back.

Activations carry a small fixed header first (dtype, whether a gradient will come back, shape), so
micro-batches may differ in size and stages need not know each other's output shapes. Gradients
need no header: they have the shape of the activation they belong to, which both sides know.

Sends are non-blocking (``isend``): the stage goes on computing while the message travels, and
:meth:`StageLink.wait_sends` completes them at the end of a step. With a ``key`` that fixes the
shape (the runtime uses the pipeline input's shape), the header goes only once per key, and the
receiver posts its receive ahead (``prefetch_*``, ``irecv``) so the transfer overlaps its compute.
Receives complete under the process group's deadline. Every failure becomes a
:class:`~spread.errors.CollectiveError` naming this rank, the operation (``recv_act[mb 3]``), its
sequence number and the peer rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable

import torch
import torch.distributed as dist

from spread.comm.ops import classify_error
from spread.errors import CollectiveError, SpreadError

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
        self._sent_meta: dict[Hashable, tuple] = {}  # key -> (dtype, requires_grad, shape) sent
        self._recv_meta: dict[Hashable, tuple] = {}  # key -> the same, received
        # keyed by (micro-batch, part)
        self._posted_acts: dict[tuple[int, int], tuple[_PendingRecv, torch.Tensor, bool]] = {}
        self._posted_grads: dict[tuple[int, int], tuple[_PendingRecv, torch.Tensor]] = {}

    def _fail(self, op: str, seq: int, peer: int, exc: BaseException) -> CollectiveError:
        err = classify_error(self.rank, op, seq, exc)
        return type(err)(self.rank, op, seq, err.detail, peer=peer)

    def _isend(self, tensor: torch.Tensor, peer: int, op: str) -> None:
        seq = next(self._seq)
        try:
            work = dist.isend(tensor, dst=peer, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail(op, seq, peer, exc) from exc
        assert work is not None  # None only for a rank outside the group
        self._sends.append((work, tensor, op, seq, peer))

    def _irecv(self, tensor: torch.Tensor, peer: int | None, op: str) -> _PendingRecv:
        assert peer is not None
        seq = next(self._seq)
        try:
            work = dist.irecv(tensor, src=peer, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail(op, seq, peer, exc) from exc
        assert work is not None  # None only for a rank outside the group
        return _PendingRecv(self, work, op, seq, peer)

    def _recv(self, tensor: torch.Tensor, peer: int, op: str) -> torch.Tensor:
        seq = next(self._seq)
        try:
            dist.recv(tensor, src=peer, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail(op, seq, peer, exc) from exc
        return tensor

    # -- activations (forward direction) ---------------------------------------------------------
    def send_activation(
        self, tensor: torch.Tensor, microbatch: int, key: Hashable = None, part: int = 0
    ) -> None:
        """Send an activation; its header only the first time ``key`` is seen (``None``: always).

        ``key`` must determine the activation's dtype and shape (the runtime uses the shape of the
        micro-batch's input to the whole pipeline, known to every stage): then both sides know the
        shape of later messages, and the receiver can post its receive before the data is ready.
        A stage passing several tensors sends them as ``part`` 0, 1, ... of the micro-batch, in order.
        """
        assert self.next_rank is not None, "the last stage sends no activations"
        data = tensor.detach().contiguous()
        meta = (data.dtype, bool(tensor.requires_grad), tuple(data.shape))
        known = self._sent_meta.get((key, part)) if key is not None else None
        where = _where(microbatch, part)
        if known is None:
            header = encode_header(data, tensor.requires_grad).to(self._header_device)
            self._isend(header, self.next_rank, f"send_act_header[{where}]")
            if key is not None:
                self._sent_meta[(key, part)] = meta
        elif known != meta:
            raise SpreadError(
                f"rank {self.rank}: micro-batch {microbatch}'s activation is {meta}, but an earlier "
                f"micro-batch with the same input shape gave {known}; pipeline stages must produce "
                f"shapes that depend only on the input's shape"
            )
        self._isend(data, self.next_rank, f"send_act[{where}]")

    def prefetch_activation(self, microbatch: int, key: Hashable, part: int = 0) -> bool:
        """Post the receive of ``microbatch``'s activation now, when ``key``'s shape is known.

        Call it only for the next activation in order (receives are matched in posting order).
        """
        meta = self._recv_meta.get((key, part)) if key is not None else None
        if meta is None or (microbatch, part) in self._posted_acts:
            return False
        dtype, requires_grad, shape = meta
        data = torch.empty(shape, dtype=dtype, device=self.device)
        self._posted_acts[(microbatch, part)] = (
            self._irecv(data, self.prev_rank, f"recv_act[{_where(microbatch, part)}]"),
            data,
            requires_grad,
        )
        return True

    def recv_activation(
        self, microbatch: int, key: Hashable = None, part: int = 0
    ) -> tuple[torch.Tensor, bool]:
        """The next activation from the previous stage, and whether it wants a gradient back."""
        assert self.prev_rank is not None, "the first stage receives no activations"
        posted = self._posted_acts.pop((microbatch, part), None)
        if posted is not None:
            pending, data, requires_grad = posted
            pending.wait()
            return data, requires_grad
        meta = self._recv_meta.get((key, part)) if key is not None else None
        where = _where(microbatch, part)
        if meta is None:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._header_device)
            self._recv(header, self.prev_rank, f"recv_act_header[{where}]")
            meta = decode_header(header.cpu())
            if key is not None:
                self._recv_meta[(key, part)] = meta
        dtype, requires_grad, shape = meta
        data = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv(data, self.prev_rank, f"recv_act[{where}]")
        return data, requires_grad

    # -- gradients (backward direction) ----------------------------------------------------------
    def send_grad(self, grad: torch.Tensor, microbatch: int, part: int = 0) -> None:
        assert self.prev_rank is not None, "the first stage sends no gradients"
        self._isend(grad.detach().contiguous(), self.prev_rank, f"send_grad[{_where(microbatch, part)}]")

    def prefetch_grad(self, like: torch.Tensor, microbatch: int, part: int = 0) -> None:
        """Post the receive of ``microbatch``'s output gradient now (call in micro-batch order)."""
        if (microbatch, part) in self._posted_grads:
            return
        grad = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        self._posted_grads[(microbatch, part)] = (
            self._irecv(grad, self.next_rank, f"recv_grad[{_where(microbatch, part)}]"),
            grad,
        )

    def recv_grad(self, like: torch.Tensor, microbatch: int, part: int = 0) -> torch.Tensor:
        assert self.next_rank is not None, "the last stage receives no gradients"
        posted = self._posted_grads.pop((microbatch, part), None)
        if posted is not None:
            posted[0].wait()
            return posted[1]
        grad = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        return self._recv(grad, self.next_rank, f"recv_grad[{_where(microbatch, part)}]")

    def has_posted(self) -> bool:
        return bool(self._posted_acts or self._posted_grads)

    def close(self) -> None:
        """Forget transfers still in flight (after a failed step nobody will wait for them) and the
        process group, whose worker threads are joined once nothing refers to it."""
        self._sends.clear()
        self._posted_acts.clear()
        self._posted_grads.clear()
        self.group = None

    def wait_sends(self) -> None:
        """Complete every send started so far (their buffers may be reused afterwards)."""
        sends, self._sends = self._sends, []
        for work, _tensor, op, seq, peer in sends:
            try:
                work.wait()
            except (RuntimeError, dist.DistError) as exc:
                raise self._fail(op, seq, peer, exc) from exc


def _where(microbatch: int, part: int) -> str:
    return f"mb {microbatch}" if part == 0 else f"mb {microbatch} part {part}"


class _PendingRecv:
    """A posted receive; ``wait()`` raises the same named errors as a blocking one."""

    def __init__(self, link: StageLink, work: dist.Work, op: str, seq: int, peer: int) -> None:
        self.link, self.work, self.op, self.seq, self.peer = link, work, op, seq, peer

    def wait(self) -> None:
        try:
            self.work.wait()
        except (RuntimeError, dist.DistError) as exc:
            raise self.link._fail(self.op, self.seq, self.peer, exc) from exc
