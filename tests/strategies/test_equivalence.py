"""The spine: every synchronous strategy gives the weights of one device on the same global batch."""

from __future__ import annotations

import os

import pytest
from _equivalence_cases import max_relative_difference, train_custom_loop

import spread
from spread.testing import run_ranks

OPTIMIZERS = ["sgd_momentum", "adamw"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference() -> dict:
    return {name: train_custom_loop(spread.OneDeviceStrategy("cpu"), name) for name in OPTIMIZERS}


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_mirrored_equals_one_device(reference, replicas, optimizer_name):
    strategy = spread.MirroredStrategy(num_replicas=replicas, intra_op_threads=1)
    try:
        weights = train_custom_loop(strategy, optimizer_name)
    finally:
        strategy.close()
    assert max_relative_difference(weights, reference[optimizer_name]) <= TOLERANCE


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_central_storage_equals_one_device(reference, replicas, optimizer_name):
    strategy = spread.CentralStorageStrategy(num_replicas=replicas, intra_op_threads=1)
    try:
        weights = train_custom_loop(strategy, optimizer_name)
    finally:
        strategy.close()
    assert max_relative_difference(weights, reference[optimizer_name]) <= TOLERANCE


def _mwms_worker(optimizer_names: list[str]) -> dict:
    rank = int(os.environ["RANK"])
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        # Non-chief ranks start from different weights: the chief's must win (broadcast at scope exit).
        return {name: train_custom_loop(strategy, name, init_seed=rank * 101) for name in optimizer_names}
    finally:
        strategy.close()


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.processes
def test_multi_worker_mirrored_equals_one_device(reference, nprocs):
    per_rank = run_ranks(_mwms_worker, nprocs, args=(OPTIMIZERS,), timeout=180)
    for name in OPTIMIZERS:
        for rank, weights in enumerate(per_rank):
            diff = max_relative_difference(weights[name], reference[name])
            assert diff <= TOLERANCE, f"rank {rank}, {name}: max relative difference {diff:.2e}"


COMPRESSED_TOLERANCE = 2e-2  # bf16 gradients: ~3 significant digits per step, over 20 steps


def _mwms_every_algorithm(names: list[str]) -> dict:
    """One process group for all configurations: the first strategy owns it, later ones reuse it."""
    rank = int(os.environ["RANK"])
    owner = spread.MultiWorkerMirroredStrategy("native")
    out = {}
    try:
        for name in names:
            for label, cap, compression in (
                ("bucketed", 0.0005, None),
                ("one_bucket", 1e4, None),
                ("bf16", 0.0005, "bf16"),
            ):
                strategy = spread.MultiWorkerMirroredStrategy(
                    name, bucket_cap_mb=cap, compression=compression
                )
                try:
                    out[(name, label)] = train_custom_loop(strategy, "sgd_momentum", init_seed=rank * 101)
                finally:
                    strategy.close()
        return out
    finally:
        owner.close()


@pytest.mark.processes
def test_multi_worker_mirrored_every_algorithm_equals_one_device(reference):
    from spread.strategies.multi_worker_mirrored import COMMUNICATIONS

    per_rank = run_ranks(_mwms_every_algorithm, 2, args=(list(COMMUNICATIONS),), timeout=240)
    worst_compressed = 0.0
    for rank, results in enumerate(per_rank):
        for (name, label), weights in results.items():
            diff = max_relative_difference(weights, reference["sgd_momentum"])
            if label == "bf16":
                worst_compressed = max(worst_compressed, diff)
                assert diff <= COMPRESSED_TOLERANCE, f"rank {rank}, {name} bf16: {diff:.2e}"
            else:
                assert diff <= TOLERANCE, f"rank {rank}, {name} {label}: max relative difference {diff:.2e}"
    print(f"bf16 compression: max relative weight difference {worst_compressed:.2e}")
