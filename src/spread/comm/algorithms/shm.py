"""``shm``: ranks on one machine sum through shared memory instead of loopback TCP.

Why: between processes on one host, gloo's all-reduce goes through the loopback network (latency
bound, and most of its CPU time is kernel time), while reading another process's memory through a
shared mapping costs what a ``memcpy`` costs. So the ranks map the same pages and each one sums a
slice of the buffer.

**Registered buffers (zero copy).** :meth:`ShmAllReduce.allocate` returns a tensor that lives inside
a shared segment holding one copy per rank (collective: every rank allocates the same sizes in the
same order; :class:`~spread.comm.bucketing.GradientReducer` allocates its buckets this way). An
all-reduce of a registered buffer (or of any slice of one) is then:

1. barrier: every rank has written its input;
2. rank ``r`` sums slice ``r`` over the ``N`` copies (in rank order, fp16/bf16 in fp32, rounded
   once) and writes the sum into every rank's copy of that slice, in cache-sized pieces;
3. barrier: every slice is summed, so every rank's copy holds the full sum.

Each rank reads and writes one buffer's worth of bytes (its ``1/N`` slice of each of the ``N``
copies), the least any scheme can move: no copy in, no copy out. Between step 3
and the next call's step 1 nobody writes another rank's copy, so the owner may read and refill it.

**Other buffers** go through a per-rank staging slot of ``chunk_bytes`` (default 8 MiB) in the
same way, with a copy in before step 1 and a copy out after step 3, chunk by chunk.

**Barriers** are two-byte datagrams (the sender's rank) over Unix sockets in Linux's abstract
namespace (nothing appears in the file system): a rank sends to every peer, then blocks until every
peer's message for this barrier arrived (a peer can be at most one barrier ahead, so the count per
peer says which barrier a message belongs to). A blocked rank sleeps in the kernel instead of
spinning, so on a busy machine it gives its core away and wakes within microseconds; the system
calls also order the memory writes before them, on any CPU. A barrier raises
:class:`~spread.errors.CollectiveTimeout` at the collective deadline naming the ranks that did not
arrive; while it waits it probes the missing peers every second, and a peer whose socket is gone
(its process exited) fails the barrier at once with :class:`~spread.errors.PeerLostError`. Linux
only (abstract sockets, ``memfd_create``).

**Only the peers are heard.** Abstract socket names are listed in ``/proc/net/unix`` for every local
user, and anyone may send to a listed name. So each rank holds one socket per peer, named by an HMAC
of a secret the group shares (a name reveals neither the secret nor the other names) and
*connected* to that peer's socket for it: the kernel then refuses datagrams from any other socket.
What still arrives (anything queued before the connection) must also come from the peer's socket
name, carry the kernel's credentials (``SO_PASSCRED``, which an unprivileged sender cannot forge)
naming the peer's process id as exchanged through the group at setup, be exactly two bytes and say
that peer's rank (or be a probe). Everything else is dropped and counted in ``dropped_datagrams``
(the first one logged as a warning, naming why), never acted on.

**Asynchronous calls** (``all_reduce_async``) are deferred: the sum runs, in call order, when its
``wait()`` (or any later call) needs it, on the caller's thread. With one rank per core there is no
spare core for a communication thread, and the exchange is a few milliseconds of memory traffic, so
running it after backward costs less than a thread fighting backward for the core.

**Segments have no name.** The group's first rank creates each one with ``memfd_create`` and hands
the descriptor to every peer with ``SCM_RIGHTS`` over that peer's barrier socket (connected, so only
the first rank's socket can send on it; the message is also checked like a barrier message), once
every peer has entered the all-reduce of the creation's status (so none is still in a barrier, whose
reader drops anything but an arrival). Nothing
appears in ``/dev/shm`` or anywhere in the file system, so another process of the same user cannot
open a segment and write into the sums (it could, through ``/dev/shm``, while a named file existed);
and nothing is left behind, even after a crash: the memory goes with the last mapping.

``bytes_sent`` counts what this rank writes into shared memory that other ranks read: its input
(staged buffers only) plus its summed slice once per other rank.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import mmap
import os
import resource
import secrets
import select
import socket
import struct
import sys
import time

import torch

from spread.cluster.rendezvous import default_collective_timeout
from spread.comm.algorithms.base import (
    LOW_PRECISION,
    SUPPORTED_DTYPES,
    AllReduceAlgorithm,
    PendingAllReduce,
    segment_bounds,
)
from spread.comm.flight import explain_wait
from spread.comm.ops import Collectives
from spread.comm.peers import describe_gone, host_digest
from spread.errors import CollectiveError, CollectiveTimeout, PeerLostError

DEFAULT_CHUNK_BYTES = 8 << 20
PIECE_BYTES = 256 << 10  # summed and copied out while it is still in the core's cache
_PROBE = b"\xff\xff"  # "are you there?": ignored by the receiver, refused if its socket is gone
_PROBE_EVERY = 1.0  # seconds of waiting between probes of the missing peers
_FULL_QUEUE_WAIT_MS = 1  # a peer's queue is full: wait this long for our own messages, then retry
_ALIGN = 4096  # each rank's copy starts on its own page
_MESSAGE_BYTES = 2
# A connected peer socket that closed: refused once, then "not connected".
_PEER_GONE = {errno.ECONNREFUSED, errno.ENOTCONN, errno.ECONNRESET, errno.ENOENT}
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANCILLARY_BYTES = socket.CMSG_SPACE(_UCRED.size) if hasattr(socket, "CMSG_SPACE") else 0
_SEGMENT = b"spread-shm segment "  # + the segment's number: a message carrying its descriptor
_FD = struct.Struct("i")
_SEGMENT_ANCILLARY_BYTES = (
    _ANCILLARY_BYTES + socket.CMSG_SPACE(_FD.size) if hasattr(socket, "CMSG_SPACE") else 0
)

_log = logging.getLogger(__name__)


def same_host(collectives: Collectives) -> bool:
    """Whether every rank of the group runs on this machine (collective: all ranks must call)."""
    if collectives.world_size == 1:
        return True
    mine = torch.tensor([host_digest()], dtype=torch.int64, device=collectives.device)
    lo, hi = mine.clone(), mine.clone()
    collectives.all_reduce(lo, "min", name="same_host")
    collectives.all_reduce(hi, "max", name="same_host")
    return bool(lo.item() == hi.item())


def shm_supported() -> bool:
    """Whether this system has what ``shm`` uses (Linux: abstract Unix sockets, shared files)."""
    return sys.platform.startswith("linux")


def _segment_error(code: int, size: int) -> OSError:
    """What every rank raises when the first rank could not make a shared segment."""
    why = os.strerror(code)
    if code == errno.EFBIG:
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        why += (
            f" (the file-size limit, `ulimit -f`, is {soft} bytes here, and the kernel counts shared "
            f"memory as a file)"
        )
    return OSError(
        code,
        f"communication 'shm' could not create its {size / 2**20:.1f} MiB shared segment on rank 0: {why}; "
        f"raise the limit or use communication='native'",
    )


def shm_unlimited(collectives: Collectives) -> bool:
    """Whether no rank has a file-size limit, which the kernel applies to shared segments too
    (collective: all ranks must call)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    free = torch.tensor([1 if soft == resource.RLIM_INFINITY else 0], device=collectives.device)
    collectives.all_reduce(free, "min", name="shm_unlimited")
    return bool(free.item())


def _where_they_are() -> str:
    """Where the ranks this one waits for are, from the flight records (when this process keeps them)."""
    culprits = explain_wait()
    return f"; {culprits}" if culprits else ""


def _exited_here() -> str:
    """Which ranks of the job on this host have exited: the one that left first may have left because
    another died (a rank stops when it loses a peer), so the message lists them all."""
    gone = describe_gone()
    return f"; exited on this host: {gone}" if gone else ""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _address(secret: bytes, sender: int, receiver: int) -> bytes:
    """The abstract socket name of ``sender``'s socket for ``receiver``: nobody without the secret
    can derive it, nor any other name from it."""
    tag = hmac.new(secret, f"shm barrier {sender}->{receiver}".encode(), hashlib.sha256).hexdigest()
    return f"\0spread-shm-{tag[:32]}".encode()


class _PeerLink:
    """This rank's datagram socket for one peer, and what arrived on it."""

    def __init__(self, peer: int, pid: int, uid: int, gid: int, address: bytes) -> None:
        self.peer, self.pid, self.address = peer, pid, address
        self.message = peer.to_bytes(_MESSAGE_BYTES, "little")  # "rank ``peer`` arrived"
        # recvmsg's answer for the peer's arrival, compared in one go (the barrier's hot path)
        credentials = [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, _UCRED.pack(pid, uid, gid))]
        self.expected = (self.message, credentials, 0, address)
        self.arrived = 0  # barrier messages received from the peer
        self.dropped = 0  # datagrams that did not come from the peer
        self.last_problem = ""
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)

    def take_queued(self) -> str | None:
        """Count every queued message of the peer, drop the rest; why the last dropped one was
        dropped (None if none was)."""
        problem = None
        while True:
            try:
                received = self.socket.recvmsg(_MESSAGE_BYTES, _ANCILLARY_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return problem
            problem = self._count(received) or problem

    def _count(self, received: tuple[bytes, list, int, object]) -> str | None:
        """Count ``received`` if it is the peer's arrival, pass over its probe, drop anything else;
        why it was dropped (None if it was not)."""
        if received == self.expected:
            self.arrived += 1
            return None
        why = self._problem(*received)
        if why is None:  # a probe, or an arrival whose user or group reads differently here
            if received[0] != _PROBE:
                self.arrived += 1
            return None
        self.dropped += 1
        self.last_problem = why
        _log.debug("shared-memory barrier for rank %d: dropped a datagram (%s)", self.peer, why)
        return why

    def send_segment(self, number: int, fd: int, deadline: float) -> bool:
        """Hand the descriptor of shared segment ``number`` to the peer; False if its queue stayed
        full until ``deadline``. Raises ``OSError`` (``ECONNREFUSED``...) if the peer is gone."""
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _FD.pack(fd))]
        while True:
            try:
                self.socket.sendmsg([_SEGMENT + str(number).encode()], rights, socket.MSG_DONTWAIT)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(_FULL_QUEUE_WAIT_MS / 1000)

    def take_segment(self, number: int, deadline: float) -> int | None:
        """The descriptor of shared segment ``number`` from the peer (the group's first rank), or
        None at ``deadline``. The peer's probes and arrivals queued before it are counted as usual;
        anything else is dropped and any descriptor it carried closed."""
        wanted = _SEGMENT + str(number).encode()
        poller = select.poll()
        poller.register(self.socket, select.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if not poller.poll(1000 * min(remaining, _PROBE_EVERY)):
                continue
            try:
                data, ancillary, flags, sender = self.socket.recvmsg(
                    len(wanted) + 1, _SEGMENT_ANCILLARY_BYTES, socket.MSG_DONTWAIT
                )
            except BlockingIOError:
                continue
            fds = _received_fds(ancillary)
            pid = _sender_pid(ancillary)
            intact = not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)
            if data == wanted and len(fds) == 1 and intact and sender == self.address and pid == self.pid:
                return fds[0]
            for fd in fds:
                os.close(fd)
            if fds or data.startswith(_SEGMENT):
                self.dropped += 1
                self.last_problem = f"a segment message that is not rank {self.peer}'s segment {number}"
                continue
            credentials = [c for c in ancillary if c[1] == socket.SCM_CREDENTIALS]
            self._count((data, credentials, flags, sender))

    def _problem(self, data: bytes, ancillary: list, flags: int, sender: object) -> str | None:
        """Why a datagram is not the peer's barrier message, or None if it is."""
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) != _MESSAGE_BYTES:
            return f"not {_MESSAGE_BYTES} bytes"
        if sender != self.address:
            return f"sent from {sender!r}, not from rank {self.peer}'s socket"
        pid = _sender_pid(ancillary)
        if pid != self.pid:
            return f"sent by process {pid}, not by rank {self.peer}'s process {self.pid}"
        if data != self.message and data != _PROBE:
            return f"says {data.hex()}, neither rank {self.peer}'s arrival nor a probe"
        return None


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an ``SCM_RIGHTS`` record brought into this process (the caller owns them)."""
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % _FD.size
            fds.extend(fd for (fd,) in _FD.iter_unpack(payload[:usable]))
    return fds


def _sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The sender's process id from the kernel's ``SCM_CREDENTIALS`` record, None without one."""
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
            return _UCRED.unpack_from(payload)[0]
    return None


class _Segment:
    """One shared mapping with ``N`` equally sized, page-aligned per-rank regions."""

    def __init__(self, mm: mmap.mmap, offset: int, region_bytes: int, world_size: int) -> None:
        self.mm, self.offset, self.region_bytes = mm, offset, region_bytes
        self.world_size = world_size
        self.base = 0  # address of region 0, set once a view exists
        self.views: dict[torch.dtype, list[torch.Tensor]] = {}

    def regions(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's region as a 1-D tensor of ``dtype``."""
        have = self.views.get(dtype)
        if have is None:
            itemsize = torch.empty(0, dtype=dtype).element_size()
            count = self.region_bytes // itemsize
            have = [
                torch.frombuffer(
                    self.mm, dtype=dtype, count=count, offset=self.offset + k * self.region_bytes
                )
                for k in range(self.world_size)
            ]
            self.views[dtype] = have
            self.base = have[0].data_ptr()
        return have


class ShmAllReduce(AllReduceAlgorithm):
    """Shared-memory all-reduce for CPU buffers of ranks on one machine."""

    name = "shm"
    overlaps_caller = False  # asynchronous calls are deferred to wait(), see the module docstring

    def __init__(
        self,
        collectives: Collectives,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> None:
        super().__init__(collectives)
        if chunk_bytes < 64:
            raise ValueError(f"chunk_bytes must be at least 64, got {chunk_bytes!r}")
        if not shm_supported():
            raise ValueError(f"communication 'shm' needs Linux; this system is {sys.platform}. Use 'native'")
        if not same_host(collectives):
            raise ValueError(
                "communication 'shm' needs every rank on one machine, but the ranks run on different "
                "hosts; use 'hierarchical' (shared memory inside each node) or 'native'"
            )
        self.chunk_bytes = _round_up(chunk_bytes, 64)
        self.timeout = default_collective_timeout() if timeout is None else timeout
        self._generation = 0
        self._segments_made = 0
        self._segments: list[_Segment] = []  # [0]: the staging slots; then registered buffers
        self._peer_views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
        self._deferred: list[tuple[torch.Tensor, int]] = []
        self._broken: CollectiveError | None = None  # a failed barrier leaves the ranks out of step
        self._links: list[_PeerLink] = []
        self._warned_drop = False
        if self.world_size > 1:
            try:
                self._connect()
                self._staging = self._new_segment(self.chunk_bytes)
            except BaseException:
                self.close()
                raise

    # -- signalling -------------------------------------------------------------------------------
    def _secret(self, what: str) -> bytes:
        """16 random bytes from the group's first rank, the same on every rank (collective)."""
        token = torch.zeros(16, dtype=torch.uint8, device=self.collectives.device)
        if self.rank == 0:
            token.copy_(torch.tensor(list(secrets.token_bytes(16)), dtype=torch.uint8))
        self.collectives.broadcast(token, src=self.peers[0], name=f"{what}.token")
        return bytes(token.cpu().tolist())

    def _connect(self) -> None:
        """Open one datagram socket per peer, connected to that peer's socket for this rank, and
        learn the peers' process ids (collective)."""
        secret = self._secret("shm.signal")
        mine = torch.tensor([os.getpid(), os.geteuid(), os.getegid()], dtype=torch.int64)
        creds: list[tuple[int, int, int]] = [
            (int(c[0]), int(c[1]), int(c[2]))
            for c in self.collectives.all_gather(mine.to(self.collectives.device), name="shm.signal.pids")
        ]
        links: list[_PeerLink] = []
        try:
            for k in range(self.world_size):
                if k != self.rank:
                    links.append(_PeerLink(k, *creds[k], _address(secret, k, self.rank)))
                    links[-1].socket.bind(_address(secret, self.rank, k))
            self.collectives.barrier(name="shm.bind")
            for link in links:
                link.socket.connect(link.address)  # from now on the kernel takes only that peer's
            self.collectives.barrier(name="shm.connect")
        except BaseException:
            for link in links:
                link.socket.close()
            raise
        self._links = links
        self._link_of_fd = {link.socket.fileno(): link for link in links}
        self._poller = select.poll()
        for link in links:
            self._poller.register(link.socket, select.POLLIN)
        self._barrier("shm.connect")  # the path works both ways; drops what was queued before

    @property
    def dropped_datagrams(self) -> int:
        """Datagrams that reached this rank's barrier sockets without coming from a peer (dropped)."""
        return sum(link.dropped for link in self._links)

    # -- shared segments ---------------------------------------------------------------------------
    def _map(self, size: int, what: str) -> mmap.mmap:
        """A zero-filled shared mapping of ``size`` bytes, created by the first rank and handed to
        every rank as a descriptor: it never has a name (collective)."""
        number = self._segments_made
        self._segments_made += 1
        fd = -1
        try:
            failure = 0
            if self.rank == 0:
                try:
                    fd = os.memfd_create(f"spread-shm-{number}", os.MFD_CLOEXEC)
                    os.ftruncate(fd, size)
                except OSError as exc:
                    failure = exc.errno or errno.EIO
            status = torch.tensor([failure], dtype=torch.int64, device=self.collectives.device)
            # An all-reduce, not a broadcast: it ends on the first rank only once every rank has
            # entered it, so no rank is still reading its barrier sockets (which drop anything but
            # an arrival) when the segment's descriptor reaches them. A broadcast's root may go on
            # as soon as its message is sent; a late peer then dropped the descriptor and waited
            # in take_segment until the deadline ("rank 0 did not hand over the shared segment").
            self.collectives.all_reduce(status, "max", name=f"{what}.create")
            if int(status.item()):
                raise _segment_error(int(status.item()), size)
            deadline = time.monotonic() + self.timeout
            if self.rank == 0:
                for link in self._links:
                    self._hand_over(link, number, fd, deadline, what)
            else:
                received = self._links[0].take_segment(number, deadline)  # links[0]: the first rank's
                if received is None:
                    raise CollectiveTimeout(
                        self.rank, what, self._generation, "rank 0 did not hand over the shared segment"
                    )
                fd = received
            return mmap.mmap(fd, size)
        finally:
            if fd >= 0:
                os.close(fd)  # the mapping keeps the memory; the last one to go frees it

    def _hand_over(self, link: _PeerLink, number: int, fd: int, deadline: float, what: str) -> None:
        try:
            sent = link.send_segment(number, fd, deadline)
        except OSError as exc:
            if exc.errno not in _PEER_GONE:
                raise
            raise PeerLostError(
                self.rank, what, self._generation, f"rank {link.peer} left{_exited_here()}", peer=link.peer
            ) from None
        if not sent:
            raise CollectiveTimeout(
                self.rank, what, self._generation, f"rank {link.peer}'s barrier queue stayed full"
            )

    def _new_segment(self, region_bytes: int) -> _Segment:
        region_bytes = _round_up(max(region_bytes, 64), _ALIGN)
        mm = self._map(region_bytes * self.world_size, "shm.allocate")
        segment = _Segment(mm, 0, region_bytes, self.world_size)
        self._segments.append(segment)
        return segment

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zero-filled buffer in shared memory, all-reduced without copies (collective: every rank
        must allocate the same ``numel`` and ``dtype`` in the same order)."""
        if torch.device(device).type != "cpu" or self.world_size == 1:
            return super().allocate(numel, dtype, device)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        segment = self._new_segment(numel * itemsize)
        return segment.regions(dtype)[self.rank][:numel]

    def _registered(self, buffer: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's copy of ``buffer`` if it lies in a registered segment, else None."""
        key = (buffer.data_ptr(), buffer.numel(), buffer.dtype)
        have = self._peer_views.get(key)
        if have is not None:
            return have
        nbytes = buffer.numel() * buffer.element_size()
        for segment in self._segments[1:]:
            regions = segment.regions(buffer.dtype)
            start = buffer.data_ptr() - regions[self.rank].data_ptr()
            if start >= 0 and start + nbytes <= segment.region_bytes and start % buffer.element_size() == 0:
                first = start // buffer.element_size()
                have = [region[first : first + buffer.numel()] for region in regions]
                self._peer_views[key] = have
                return have
        return None

    # -- barriers ---------------------------------------------------------------------------------
    def _barrier(self, op: str) -> None:
        if self._broken is not None:
            raise self._broken
        try:
            self._wait_for_peers(op)
        except CollectiveError as exc:  # the ranks are out of step: no later call can complete
            self._broken = exc
            raise

    def _wait_for_peers(self, op: str) -> None:
        self._generation += 1
        generation = self._generation
        deadline = time.monotonic() + self.timeout
        message = self.rank.to_bytes(_MESSAGE_BYTES, "little")
        for link in self._links:
            while not self._send(op, link, message):  # the peer's queue is full:
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(
                        self.rank, op, generation, f"rank {link.peer}'s barrier queue stayed full"
                    )
                # Take ours meanwhile (no deadlock between full queues).
                self._take_queued(_FULL_QUEUE_WAIT_MS)
        while True:
            behind = [link for link in self._links if link.arrived < generation]
            if not behind:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeout(
                    self.rank,
                    op,
                    generation,
                    f"ranks {[link.peer for link in behind]} did not reach the shared-memory barrier"
                    + self._drop_note()
                    + _where_they_are(),
                )
            if self._take_queued(1000 * min(_PROBE_EVERY, remaining)):
                continue
            # Still waiting: is every missing peer still there? (Count what slipped in first.)
            self._take_queued(0)
            for link in behind:
                if link.arrived < generation:
                    self._send(op, link, _PROBE)

    def _send(self, op: str, link: _PeerLink, message: bytes) -> bool:
        """Send ``message`` to ``link``'s peer without blocking; False if its queue is full. A closed
        socket means the peer process is gone: :class:`~spread.errors.PeerLostError`."""
        try:
            link.socket.send(message, socket.MSG_DONTWAIT)
            return True
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno not in _PEER_GONE:
                raise
            raise PeerLostError(
                self.rank,
                op,
                self._generation,
                f"rank {link.peer} left (its shared-memory barrier socket is closed){_exited_here()}",
                peer=link.peer,
            ) from None

    def _take_queued(self, wait_ms: float) -> bool:
        """Wait up to ``wait_ms`` for datagrams, then count every queued one; False if none came."""
        # The sockets stay blocking (so MSG_DONTWAIT means "do not wait"); poll bounds the wait.
        ready = self._poller.poll(wait_ms)
        for fd, _ in ready:
            problem = self._link_of_fd[fd].take_queued()
            if problem is not None and not self._warned_drop:
                self._warned_drop = True
                _log.warning(
                    "rank %d: dropped a datagram on the shared-memory barrier socket for rank %d (%s); "
                    "something other than the peer is sending to it (counted in dropped_datagrams)",
                    self.rank,
                    self._link_of_fd[fd].peer,
                    problem,
                )
        return bool(ready)

    def _drop_note(self) -> str:
        """For a timeout's message: what was dropped (a peer whose messages all fail the checks,
        e.g. from another PID namespace, shows up here)."""
        problems = [f"on rank {k.peer}'s socket: {k.last_problem}" for k in self._links if k.dropped]
        if not problems:
            return ""
        return f" ({self.dropped_datagrams} datagrams dropped; the last {'; '.join(problems)})"

    # -- the algorithm ----------------------------------------------------------------------------
    def _sum_my_slice(self, copies: list[torch.Tensor], numel: int) -> int:
        """Sum this rank's slice of ``copies[k][:numel]`` over k and write it into every copy;
        return the slice's length."""
        n, r = self.world_size, self.rank
        bounds = segment_bounds(numel, n)
        lo, hi = bounds[r], bounds[r + 1]
        dtype = copies[0].dtype
        low = dtype in LOW_PRECISION
        step = max(1, PIECE_BYTES // copies[0].element_size())
        acc_all = None
        if low or n > 2:
            acc_all = self._scratch(
                "acc", torch.float32 if low else dtype, min(step, hi - lo), copies[0].device
            )
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            parts = [c[a:b] for c in copies]
            if acc_all is None:  # two ranks, full precision: sum in place, copy to the other
                parts[0].add_(parts[1])
                parts[1].copy_(parts[0])
                continue
            acc = acc_all[: b - a]
            acc.copy_(parts[0])
            for part in parts[1:]:
                acc.add_(part)
            parts[0].copy_(acc)
            for part in parts[1:]:
                part.copy_(parts[0])
        return hi - lo

    def _all_reduce_flat(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu":
            raise ValueError(f"communication 'shm' reduces CPU buffers, got one on {buffer.device}")
        self._flush()
        self._reduce_now(buffer)

    def _reduce_now(self, buffer: torch.Tensor) -> None:
        n, itemsize = self.world_size, buffer.element_size()
        copies = self._registered(buffer)
        if copies is not None:
            self._barrier("shm.all_reduce")
            mine = self._sum_my_slice(copies, buffer.numel())
            self._barrier("shm.all_reduce")
            self.bytes_sent += (n - 1) * mine * itemsize
            return
        slots = self._staging.regions(buffer.dtype)
        chunk = self._staging.region_bytes // itemsize
        for start in range(0, buffer.numel(), chunk):
            piece = buffer[start : start + chunk]
            m = piece.numel()
            slots[self.rank][:m].copy_(piece)
            self._barrier("shm.all_reduce")
            mine = self._sum_my_slice([s[:m] for s in slots], m)
            self._barrier("shm.all_reduce")
            piece.copy_(slots[self.rank][:m])
            self.bytes_sent += (m + (n - 1) * mine) * itemsize

    def all_reduce_async(self, buffer: torch.Tensor) -> PendingAllReduce:
        """Queue the sum of ``buffer``; it runs in call order when ``wait()`` or a later call needs it."""
        seq = next(self._seq)
        if not self._validate(buffer):
            return PendingAllReduce()
        if buffer.device.type != "cpu":
            raise ValueError(f"communication 'shm' reduces CPU buffers, got one on {buffer.device}")
        self._deferred.append((buffer, seq))
        return PendingAllReduce(run=lambda: self._flush(upto=seq))

    def _flush(self, upto: int | None = None) -> None:
        """Run the queued asynchronous calls in order (those up to ``upto``, or all)."""
        if self._broken is not None:
            raise self._broken
        while self._deferred and (upto is None or self._deferred[0][1] <= upto):
            buffer, seq = self._deferred.pop(0)
            self._run_deferred(buffer, seq)

    def _run_deferred(self, buffer: torch.Tensor, seq: int) -> None:
        op = self._op(seq)
        try:
            if self.debug:
                code = SUPPORTED_DTYPES.index(buffer.dtype)
                self.collectives.check_same([buffer.numel(), code], what=f"{op} buffer numel and dtype")
            self._reduce_now(buffer)
        except CollectiveError:  # the ranks are out of step: the queued calls can never complete
            self._deferred.clear()
            raise

    def broadcast_flat(self, buffer: torch.Tensor, src: int = 0) -> None:
        """Copy group rank ``src``'s 1-D contiguous CPU ``buffer`` to every rank (collective)."""
        if self.world_size == 1 or buffer.numel() == 0:
            return
        self._flush()
        copies = self._registered(buffer)
        if copies is not None:
            self._barrier("shm.broadcast")
            if self.rank == src:
                for k, copy in enumerate(copies):
                    if k != src:
                        copy.copy_(buffer)
                        self.bytes_sent += buffer.numel() * buffer.element_size()
            self._barrier("shm.broadcast")
            return
        slots = self._staging.regions(buffer.dtype)
        chunk = slots[0].numel()
        for start in range(0, buffer.numel(), chunk):
            piece = buffer[start : start + chunk]
            if self.rank == src:
                slots[src][: piece.numel()].copy_(piece)
                self.bytes_sent += piece.numel() * piece.element_size()
            self._barrier("shm.broadcast")
            if self.rank != src:
                piece.copy_(slots[src][: piece.numel()])
            self._barrier("shm.broadcast")

    def close(self) -> None:
        self._deferred.clear()  # never waited for: running them now could wait on a rank that is gone
        super().close()
        self._peer_views.clear()
        for link in self._links:
            link.socket.close()
        if self.dropped_datagrams:
            _log.warning(
                "rank %d: the shared-memory barrier dropped %d datagrams that no peer sent",
                self.rank,
                self.dropped_datagrams,
            )
        self._links = []
        for segment in self._segments:
            segment.views.clear()
            try:
                segment.mm.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
        self._segments.clear()
