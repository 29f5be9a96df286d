"""Every all-reduce algorithm equals a float64 reference, for awkward sizes, four dtypes, 2-4 ranks.

One launch per world size: the ranks loop over algorithms x sizes x dtypes and send back what the
parent needs to compare (a digest of the result, not the 16 MB buffers themselves).
"""

from __future__ import annotations

import os

import pytest
import torch

from spread.cluster import resolve_cluster
from spread.cluster.rendezvous import rendezvous
from spread.comm import Collectives
from spread.comm.algorithms import ALGORITHM_NAMES, ALGORITHMS, make_algorithm, segment_bounds
from spread.testing import run_ranks

pytestmark = pytest.mark.processes

SIZES = [0, 1, 7, 13, 1_000_003, 4 * 2**20]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Every size in every dtype, except the 16 MB size (past shm's 8 MiB staging chunk and ring's 1 MiB
# sub-chunks: the multi-chunk paths) in float32 only: the half types sum slowly on CPU, and the suite
# must stay short.
CASES = [(numel, dtype) for numel in SIZES for dtype in DTYPES if numel < 2**22 or dtype == torch.float32]
# Relative to the largest magnitude of the exact sum: fp16/bf16 allow a few ulps per hop.
REGISTERED = ["shm", "hierarchical"]  # algorithms whose allocate() differs from a plain tensor
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 4 * 2**-10, torch.bfloat16: 4 * 2**-7}


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel % 997)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _local_world(world: int) -> int:
    return {2: 1, 3: 3, 4: 2}[world]  # 2 nodes of 1, 1 node of 3, 2 nodes of 2


def _rank_all_algorithms() -> dict:
    world = int(os.environ["WORLD_SIZE"])
    rdv = rendezvous(resolve_cluster())
    try:
        collectives = Collectives()
        rank = collectives.rank
        out: dict = {"errors": {}, "bytes": {}, "shm_files": None}
        algos = {}
        try:
            for name in ALGORITHMS:
                algos[name] = make_algorithm(name, collectives, local_world_size=_local_world(world))
            # Buffers from the algorithm's own allocator (shm: in shared memory, summed without
            # copies), sliced at an odd offset as the gradient buckets slice their arena.
            registered = {
                (name, dtype): algos[name].allocate(max(SIZES) + 3, dtype)
                for name in REGISTERED
                for dtype in DTYPES
            }
            for numel, dtype in CASES:
                mine = _input(rank, numel, dtype)
                ref = sum(_input(r, numel, dtype).double() for r in range(world))
                scale = ref.abs().max().item() if numel else 1.0
                for name, algo, buf in [
                    *((name, algo, mine.clone()) for name, algo in algos.items()),
                    *(
                        (f"{name}+allocate", algos[name], registered[(name, dtype)][3 : 3 + numel])
                        for name in REGISTERED
                    ),
                ]:
                    buf.copy_(mine)
                    before = algo.bytes_sent
                    if numel == 13:
                        algo.all_reduce_async(buf).wait()
                    else:
                        algo.all_reduce(buf)
                    err = (buf.double() - ref).abs().max().item() / scale if numel else 0.0
                    out["errors"][(name, numel, str(dtype))] = err
                    out["bytes"][(name, numel, str(dtype))] = algo.bytes_sent - before
        finally:
            for algo in algos.values():
                algo.close()
        collectives.barrier()
        out["shm_files"] = [f for f in os.listdir("/dev/shm") if f.startswith("spread-shm-")]
        return out
    finally:
        rdv.close()


@pytest.fixture(scope="module", params=[2, 3, 4])
def results(request):
    return request.param, run_ranks(_rank_all_algorithms, request.param, timeout=240)


def test_every_algorithm_matches_float64_reference(results):
    world, per_rank = results
    for rank, out in enumerate(per_rank):
        for (name, numel, dtype), err in out["errors"].items():
            tol = TOLERANCE[getattr(torch, dtype.removeprefix("torch."))]
            assert err <= tol, f"world {world} rank {rank} {name} numel {numel} {dtype}: {err:.2e} > {tol}"
        assert {k[0] for k in out["errors"]} == set(ALGORITHMS) | {f"{n}+allocate" for n in REGISTERED}


def test_ring_sends_two_n_minus_one_over_n(results):
    world, per_rank = results
    for numel, dtype in CASES:
        itemsize = torch.empty(0, dtype=getattr(torch, str(dtype).removeprefix("torch."))).element_size()
        sent = [out["bytes"][("ring", numel, str(dtype))] for out in per_rank]
        bounds = segment_bounds(numel, world)
        seg = [bounds[i + 1] - bounds[i] for i in range(world)]
        for r in range(world):
            # every segment but r+1 in reduce-scatter, every segment but r+2 in all-gather
            expected = (2 * numel - seg[(r + 1) % world] - seg[(r + 2) % world]) * itemsize
            assert sent[r] == expected
        assert sum(sent) == 2 * (world - 1) * numel * itemsize
        if numel % world == 0:
            assert all(s == 2 * (world - 1) * numel * itemsize // world for s in sent)


def test_shm_leaves_nothing_in_dev_shm(results):
    _, per_rank = results
    assert all(out["shm_files"] == [] for out in per_rank)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("spread-shm-")]


def _rank_bad_calls() -> list[str]:
    rdv = rendezvous(resolve_cluster())
    messages = []
    try:
        collectives = Collectives()
        algo = make_algorithm("ring", collectives)
        for bad in (torch.zeros(2, 2), torch.zeros(4, dtype=torch.int64), torch.zeros(8)[::2]):
            try:
                algo.all_reduce(bad)
            except ValueError as exc:
                messages.append(str(exc))
        try:
            make_algorithm("nope", collectives)
        except ValueError as exc:
            messages.append(str(exc))
        messages.append(type(make_algorithm("auto", collectives)).__name__)
        algo.close()
        return messages
    finally:
        rdv.close()


def test_validation_and_registry():
    messages = run_ranks(_rank_bad_calls, 2, timeout=60)[0]
    assert "1-D contiguous" in messages[0] and "int64" in messages[1] and "1-D contiguous" in messages[2]
    assert all(name in messages[3] for name in ALGORITHM_NAMES)
    assert messages[4] == "ShmAllReduce"


def _rank_shm_peer_never_arrives() -> str:
    from spread.comm.algorithms import ShmAllReduce
    from spread.errors import CollectiveTimeout

    rdv = rendezvous(resolve_cluster())
    try:
        collectives = Collectives()
        algo = ShmAllReduce(collectives, timeout=0.5)
        try:
            if collectives.rank == 0:
                try:
                    algo.all_reduce(torch.ones(10))
                except CollectiveTimeout as exc:
                    try:  # the ranks are out of step now: later calls fail the same way at once
                        algo.all_reduce_async(torch.ones(10)).wait()
                    except CollectiveTimeout as again:
                        return str(exc) if again is exc else "a second, different error"
                    return "the second call did not fail"
            return ""
        finally:
            collectives.barrier()
            algo.close()
    finally:
        rdv.close()


def test_shm_barrier_times_out_naming_rank_and_op():
    message = run_ranks(_rank_shm_peer_never_arrives, 2, timeout=60)[0]
    assert message.startswith("rank 0: shm.all_reduce") and "ranks [1]" in message


def _rank_bad_options() -> list[str]:
    import spread

    messages = []
    for kwargs in ({"communication": "carrier_pigeon"}, {"compression": "int4"}):
        try:
            spread.MultiWorkerMirroredStrategy(**kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_strategy_rejects_unknown_communication_and_compression():
    messages = run_ranks(_rank_bad_options, 1, timeout=60)[0]
    assert "carrier_pigeon" in messages[0] and "shm" in messages[0] and "int4" in messages[1]


def _rank_async_out_of_order_waits() -> dict:
    rdv = rendezvous(resolve_cluster())
    try:
        collectives = Collectives()
        rank, out = collectives.rank, {}
        for name in ALGORITHMS:
            algo = make_algorithm(name, collectives)
            try:
                sizes = (5, 100_003, 17)
                bufs = [algo.allocate(n, torch.float32) for n in sizes]
                for i, buf in enumerate(bufs):
                    buf.fill_(float(10 * i + rank + 1))
                pending = [algo.all_reduce_async(buf) for buf in bufs]
                for p in reversed(pending):  # waited in the opposite order to the calls
                    p.wait()
                out[name] = [sorted(set(buf.tolist())) for buf in bufs]
            finally:
                algo.close()
        return out
    finally:
        rdv.close()


def test_async_calls_complete_whatever_the_wait_order():
    per_rank = run_ranks(_rank_async_out_of_order_waits, 2, timeout=120)
    for out in per_rank:
        for name, values in out.items():
            # rank 0 holds 10i+1, rank 1 holds 10i+2: the sum is 20i+3 everywhere
            assert values == [[3.0], [23.0], [43.0]], name


def _rank_shm_peer_leaves() -> str:
    from spread.comm.algorithms import ShmAllReduce
    from spread.errors import PeerLostError

    rdv = rendezvous(resolve_cluster())
    try:
        collectives = Collectives()
        algo = ShmAllReduce(collectives, timeout=90)  # far beyond the probe interval
        collectives.barrier()
        if collectives.rank == 1:
            algo.close()  # this rank's barrier socket is gone, as if its process had exited
            collectives.barrier()
            return ""
        collectives.barrier()
        try:
            algo.all_reduce(torch.ones(10))
        except PeerLostError as exc:
            return str(exc)
        finally:
            algo.close()
        return "no error"
    finally:
        rdv.close()


def test_shm_barrier_notices_a_peer_that_left():
    message = run_ranks(_rank_shm_peer_leaves, 2, timeout=60)[0]
    assert message.startswith("rank 0: shm.all_reduce") and "rank 1 left" in message
