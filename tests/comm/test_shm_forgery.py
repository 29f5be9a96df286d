"""``shm``'s barrier hears only its peers.

Its sockets' names are listed in ``/proc/net/unix`` for every local user. A forger running as the
same user (the worst case short of root) finds them, sends garbage, a pickle, empty and one-byte
datagrams, forged "rank k arrived" messages, an out-of-range rank and probes: once while the sockets
are bound but not yet connected to their peers (the only moment the kernel lets a stranger's
datagram in), then without pause for the whole run. The run must match, bit for bit, the sums
computed here without any attack, and every datagram the kernel let in must be counted as dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch

from spread.cluster import resolve_cluster
from spread.cluster.rendezvous import rendezvous
from spread.comm import Collectives
from spread.testing import run_ranks

STEPS = 150
REGISTERED_NUMEL, STAGED_NUMEL = 4099, 1001

_FORGER = textwrap.dedent(
    """
    import errno, json, os, pickle, select, socket, sys

    pids = sys.argv[1:]
    sys.stdin.readline()  # "go": the ranks' barrier sockets are bound, not yet connected

    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    names = []
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("@"):
                names.append(b"\\0" + fields[7][1:].encode())

    payloads = [
        pickle.dumps({"rank": 1, "step": list(range(20))}),  # killed rank 0 with an IndexError
        b"",
        b"\\x01",
        b"\\x00\\x00",  # "rank 0 arrived"
        b"\\x01\\x00",  # "rank 1 arrived"
        b"\\x07\\x00",  # a rank out of range
        b"\\xff\\xff",  # a probe
        os.urandom(64),
    ]
    unbound = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    named = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    named.bind(b"\\0spread-shm-forger-" + os.urandom(8).hex().encode())
    counts = {"sockets": len(names), "accepted_before_connect": 0, "accepted": 0, "refused": 0, "other": 0}

    def send(key):
        for name in names:
            for i, payload in enumerate(payloads):
                try:
                    (unbound, named)[i % 2].sendto(payload, socket.MSG_DONTWAIT, name)
                    counts[key] += 1
                except OSError as exc:
                    counts["refused" if exc.errno == errno.EPERM else "other"] += 1

    send("accepted_before_connect")
    print(json.dumps(counts), flush=True)
    sys.stdin.readline()  # "flood": the sockets are connected
    while not select.select([sys.stdin], [], [], 0.002)[0]:  # until the ranks are done
        send("accepted")
    print(json.dumps(counts), flush=True)
    """
)


class _Forger:
    """The forger process, driven by rank 0 over its standard input and output."""

    def __init__(self, pids: list[int]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FORGER, *map(str, pids)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _line(self, timeout: float = 60) -> dict:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError("the forger did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the forger exited with {self.proc.wait(timeout=10)}")
        return json.loads(line)

    def attack_before_connect(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._line()

    def flood(self) -> None:
        self.proc.stdin.write("flood\n")
        self.proc.stdin.flush()

    def stop(self) -> dict:
        self.proc.stdin.close()
        try:
            return self._line()
        finally:
            self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


class _PausingCollectives(Collectives):
    """Collectives that run ``pause`` (on every rank, between two barriers) right after the first
    barrier ``shm`` takes once its sockets are bound, before it connects them."""

    def __init__(self, pause: Callable[[], None]) -> None:
        super().__init__()
        self._pause: Callable[[], None] | None = pause

    def barrier(self, *, name: str = "barrier") -> None:
        super().barrier(name=name)
        if self._pause is not None and name in ("shm.bind", "shm.connect"):
            pause, self._pause = self._pause, None
            pause()
            super().barrier(name=f"{name}.paused")


def _gradient(w: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """Anything that differs per rank and per step and feeds back on the weights."""
    return torch.sin(w * (rank + 1) + 0.01 * step) * (1.0 + 0.5 * rank)


def _train(algo, rank: int) -> tuple[torch.Tensor, str]:
    """Weights after STEPS updates through the all-reduce, and a digest of every sum it returned."""
    w = torch.linspace(-3.0, 3.0, REGISTERED_NUMEL + STAGED_NUMEL)
    registered = algo.allocate(REGISTERED_NUMEL, torch.float32)
    digest = hashlib.sha256()
    for step in range(STEPS):
        g = _gradient(w, rank, step)
        registered.copy_(g[:REGISTERED_NUMEL])
        staged = g[REGISTERED_NUMEL:].clone()
        algo.all_reduce(registered)  # zero copy, in shared memory
        algo.all_reduce(staged)  # through the staging slots
        total = torch.cat([registered, staged])
        digest.update(total.numpy().tobytes())
        w -= 0.05 * total
    return w, digest.hexdigest()


def _reference() -> tuple[torch.Tensor, str]:
    """The same run with the sums taken here: what two ranks must compute, unattacked."""
    w = torch.linspace(-3.0, 3.0, REGISTERED_NUMEL + STAGED_NUMEL)
    digest = hashlib.sha256()
    for step in range(STEPS):
        total = _gradient(w, 0, step) + _gradient(w, 1, step)
        digest.update(total.numpy().tobytes())
        w -= 0.05 * total
    return w, digest.hexdigest()


def _rank_under_attack() -> dict:
    import logging

    from spread.comm.algorithms import ShmAllReduce

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    handler.setLevel(logging.WARNING)
    logging.getLogger("spread.comm.algorithms.shm").addHandler(handler)

    rdv = rendezvous(resolve_cluster())
    forger = None
    out: dict = {}
    try:
        rank = int(os.environ["RANK"])
        if rank == 0:
            plain = Collectives()
            pids = [int(p.item()) for p in plain.all_gather(torch.tensor([os.getpid()]))]
            forger = _Forger(pids)
            pause = lambda: out.update(before=forger.attack_before_connect())  # noqa: E731
        else:
            plain = Collectives()
            plain.all_gather(torch.tensor([os.getpid()]))
            pause = lambda: None  # noqa: E731
        algo = ShmAllReduce(_PausingCollectives(pause), timeout=60)
        try:
            if forger is not None:
                forger.flood()
            w, digest = _train(algo, rank)
            plain.barrier()  # both ranks are done: stop the attack
            if forger is not None:
                out["after"] = forger.stop()
            out.update(weights=w, digest=digest, dropped=algo.dropped_datagrams)
        finally:
            algo.close()
        out["warnings"] = warnings
        return out
    finally:
        if forger is not None:
            forger.kill()
        rdv.close()


@pytest.mark.processes
def test_forged_datagrams_change_nothing_and_are_counted():
    first, second = run_ranks(_rank_under_attack, 2, timeout=300, collective_timeout=60)
    weights, digest = _reference()
    for out in (first, second):
        assert out["digest"] == digest  # every sum of every step, bit for bit
        assert torch.equal(out["weights"], weights)
    before, after = first["before"], first["after"]
    assert before["sockets"] == 2  # one per rank and peer: the forger found them all
    assert before["accepted_before_connect"] > 0  # unconnected sockets take anyone's datagrams ...
    assert first["dropped"] + second["dropped"] == before["accepted_before_connect"]  # ... all dropped
    assert after["accepted"] == 0 and after["refused"] > 0  # connected: the kernel refuses the rest
    for out in (first, second):
        assert out["dropped"] > 0
        assert any("dropped a datagram on the shared-memory barrier socket" in m for m in out["warnings"])
        assert any(f"dropped {out['dropped']} datagrams that no peer sent" in m for m in out["warnings"])


def test_the_reference_differs_when_a_sum_is_wrong():
    """The check above would see a single wrong sum (the run feeds back on itself)."""
    weights, _ = _reference()
    w = torch.linspace(-3.0, 3.0, REGISTERED_NUMEL + STAGED_NUMEL)
    for step in range(STEPS):
        total = _gradient(w, 0, step) + (_gradient(w, 1, step) if step != 3 else 0)
        w -= 0.05 * total
    assert (w - weights).abs().max().item() > 1e-3


_PEER = textwrap.dedent(
    """
    import os, socket, sys
    me, to = b"\\0" + sys.argv[1].encode(), b"\\0" + sys.argv[2].encode()  # abstract names
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(me)
    print(os.getpid(), flush=True)
    sys.stdin.readline()  # the receiver is bound
    s.sendto(b"\\x01\\x00", to)  # rank 1 arrived
    s.sendto(b"\\x00\\x00", to)  # another rank's arrival from rank 1's socket
    s.sendto(b"\\x01\\x00\\x00", to)  # three bytes
    s.sendto(b"\\xff\\xff", to)  # a probe: accepted, not counted
    child = os.fork()
    if child == 0:  # rank 1's socket, another process: not rank 1
        s.sendto(b"\\x01\\x00", to)
        os._exit(0)
    os.waitpid(child, 0)
    s.sendto(b"\\x01\\x00", to)  # rank 1 arrived, again
    """
)


@pytest.mark.processes
def test_a_peer_link_counts_only_its_peers_arrivals_and_says_why_it_drops(caplog):
    import logging
    import secrets
    import socket

    from spread.comm.algorithms.shm import _PeerLink

    tag = secrets.token_hex(8)
    peer_name, my_name = f"spread-shm-test-{tag}-1", f"spread-shm-test-{tag}-0"
    my_address = b"\0" + my_name.encode()
    peer = subprocess.Popen(
        [sys.executable, "-c", _PEER, peer_name, my_name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # What the group's setup exchanges: the peer's process id, user and group.
        link = _PeerLink(
            1, int(peer.stdout.readline()), os.geteuid(), os.getegid(), b"\0" + peer_name.encode()
        )
        try:
            link.socket.bind(my_address)
            peer.communicate("go\n", timeout=60)
            assert peer.returncode == 0
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
                stranger.sendto(b"\x01\x00", my_address)  # right bytes, wrong sender
            with caplog.at_level(logging.DEBUG, logger="spread.comm.algorithms.shm"):
                link.take_queued()
        finally:
            link.socket.close()
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(timeout=30)
    assert (link.arrived, link.dropped) == (2, 4)
    reasons = [r.getMessage() for r in caplog.records]
    assert len(reasons) == 4
    assert "says 0000" in reasons[0]
    assert "not 2 bytes" in reasons[1]
    assert f"not by rank 1's process {link.pid}" in reasons[2]
    assert "not from rank 1's socket" in reasons[3]


# -- the segments: nothing on the file system to open ------------------------------------------------
_SNOOPER = textwrap.dedent(
    """
    import ctypes, ctypes.util, json, mmap, os, select, struct, sys

    folder = sys.argv[1]
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    watch = libc.inotify_init1(os.O_NONBLOCK)
    if watch < 0 or libc.inotify_add_watch(watch, folder.encode(), 0x100) < 0:  # IN_CREATE
        raise OSError(ctypes.get_errno(), "inotify")
    print("ready", flush=True)
    seen, held, maps = [], [], []
    while not select.select([sys.stdin], [], [], 0)[0]:  # until the ranks are done
        if select.select([watch], [], [], 0.001)[0]:
            data, offset = os.read(watch, 65536), 0
            while offset < len(data):
                _, _, _, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16 : offset + 16 + length].rstrip(b"\\0").decode()
                offset += 16 + length
                if name.startswith("spread-shm"):
                    seen.append(name)
                    try:
                        held.append(os.open(os.path.join(folder, name), os.O_RDWR))
                    except OSError:
                        pass
        for fd in list(held):  # map a segment once it has its size: write access proven (it writes
            size = os.fstat(fd).st_size  # nothing: another job's segments may appear here too)
            if size:
                maps.append(mmap.mmap(fd, size))
                held.remove(fd)
    print(json.dumps({"seen": seen, "mapped": len(maps)}), flush=True)
    """
)


def _rank_beside_a_snooper() -> dict:
    from spread.comm.algorithms import ShmAllReduce

    rdv = rendezvous(resolve_cluster())
    try:
        algo = ShmAllReduce(Collectives(), timeout=60)
        try:
            w, digest = _train(algo, int(os.environ["RANK"]))
            with open("/proc/self/maps") as maps:
                mapped = sorted({line.split(None, 5)[-1].strip() for line in maps if "spread-shm" in line})
        finally:
            algo.close()
        return {"weights": w, "digest": digest, "mapped": mapped}
    finally:
        rdv.close()


@pytest.mark.processes
def test_a_same_user_process_watching_dev_shm_finds_no_segment_to_write_into():
    """Issue 40 item 2: a process watching ``/dev/shm`` with inotify opened each segment between its
    creation and its unlink and wrote into the gradients (weights up to 1.74 off, exit 0). Segments
    are now ``memfd``\\s handed over with ``SCM_RIGHTS``: nothing is ever created there. The watcher
    here maps what it finds but writes nothing (another job's segments would show up as well)."""
    snooper = subprocess.Popen(
        [sys.executable, "-c", _SNOOPER, "/dev/shm"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert snooper.stdout.readline().strip() == "ready"
        first, second = run_ranks(_rank_beside_a_snooper, 2, timeout=300, collective_timeout=60)
        snooper.stdin.close()
        report = json.loads(snooper.stdout.readline())
    finally:
        if snooper.poll() is None:
            snooper.kill()
        snooper.wait(timeout=30)
    weights, digest = _reference()
    for out in (first, second):
        assert out["digest"] == digest and torch.equal(out["weights"], weights)
        # every segment a rank maps is a memfd: it never had a name in /dev/shm (the snooper's own
        # findings are not asserted on: other jobs of this user may create such files meanwhile)
        assert out["mapped"] and all(name.startswith("/memfd:spread-shm-") for name in out["mapped"])
    print(f"the snooper saw {len(report['seen'])} spread-shm file(s) created meanwhile (other jobs')")


def _rank_under_a_file_size_limit() -> dict:
    import resource

    from spread.comm.algorithms import ShmAllReduce, make_algorithm

    rdv = rendezvous(resolve_cluster())
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        out: dict = {}
        try:
            ShmAllReduce(Collectives(), timeout=30)
        except OSError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        algo = make_algorithm("auto", Collectives())
        try:
            out["auto"] = algo.name
            total = torch.tensor([float(os.environ["RANK"]) + 1.0])
            algo.all_reduce(total)
            out["sum"] = total.item()
        finally:
            algo.close()
        return out
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        rdv.close()


@pytest.mark.processes
def test_a_file_size_limit_is_named_on_every_rank_and_auto_picks_native():
    """Issue 40 item 5: under ``ulimit -f`` the default all-reduce died at start-up on rank 0 with a
    bare ``File too large`` from ``ftruncate`` (the others waited for it until their timeout)."""
    for out in run_ranks(_rank_under_a_file_size_limit, 2, timeout=180, collective_timeout=30):
        assert out["error"].startswith("OSError: [Errno 27] communication 'shm' could not create its")
        assert "`ulimit -f`" in out["error"] and "communication='native'" in out["error"]
        assert out["auto"] == "native" and out["sum"] == 3.0
