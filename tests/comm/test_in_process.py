"""In-process replica all-reduces (MirroredStrategy's cross_device_ops) equal a float64 reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from spread.comm.in_process import hierarchical_copy, reduce_to_one

TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 2**-9, torch.bfloat16: 2**-6}


def _buffers(replicas: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(numel * 7 + replicas)
    return [torch.randn(numel, generator=g, dtype=torch.float64).to(dtype) for _ in range(replicas)]


def _threads(tasks) -> None:
    with ThreadPoolExecutor(max_workers=max(1, len(tasks))) as pool:
        for future in [pool.submit(task) for task in tasks]:
            future.result()


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [0, 1, 7, 1_003])
@pytest.mark.parametrize(
    "algorithm",
    [
        reduce_to_one,
        hierarchical_copy,
        lambda b: hierarchical_copy(b, num_groups=3, parallel=_threads),
        lambda b: hierarchical_copy(b, num_groups=1),
    ],
    ids=["reduce_to_one", "hierarchical_copy", "hierarchical_copy_3_groups_threads", "one_group"],
)
def test_sum_lands_in_first_buffer(algorithm, numel, replicas, dtype):
    buffers = _buffers(replicas, numel, dtype)
    others = [b.clone() for b in buffers[1:]]
    ref = sum(b.double() for b in buffers)
    algorithm(buffers)
    scale = ref.abs().max().item() if numel else 1.0
    err = (buffers[0].double() - ref).abs().max().item() / scale if numel else 0.0
    assert err <= TOLERANCE[dtype]
    if algorithm is reduce_to_one:  # it writes only the first buffer
        assert all(torch.equal(a, b) for a, b in zip(buffers[1:], others, strict=True))


def test_mismatched_buffers_are_refused():
    with pytest.raises(ValueError, match="replica 1"):
        reduce_to_one([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match="at least one"):
        hierarchical_copy([])
