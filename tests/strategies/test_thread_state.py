"""Replica threads compute under the caller's autocast, grad mode, inference mode and saved-tensor
hooks (every thread-based strategy), and capture/applied carry them between plain threads too."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import spread
from spread.strategies.thread_state import applied, capture

THREAD_STRATEGIES = {
    "mirrored": lambda: spread.MirroredStrategy(num_replicas=3, intra_op_threads=1),
    "central_storage": lambda: spread.CentralStorageStrategy(num_replicas=3, intra_op_threads=1),
}


def _seen() -> dict:
    return {
        "thread": threading.get_ident(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "dtype": torch.get_autocast_dtype("cpu"),
        "hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
    }


@pytest.fixture(params=sorted(THREAD_STRATEGIES))
def strategy(request):
    s = THREAD_STRATEGIES[request.param]()
    yield s
    s.close()


def _per_replica(strategy) -> list[dict]:
    return list(strategy.local_results(strategy.run(_seen)))


def test_replica_threads_see_the_callers_bf16_autocast(strategy):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen = _per_replica(strategy)
    assert len({s["thread"] for s in seen}) >= 2  # really other threads (the pool may reuse one)
    assert all(s["autocast"] and s["dtype"] == torch.bfloat16 for s in seen), seen


def test_replica_threads_compute_in_bf16_under_autocast(strategy):
    with strategy.scope():
        layer = nn.Linear(4, 4)
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = strategy.local_results(strategy.run(lambda x: layer(x).dtype, args=(x,)))
    assert list(out) == [torch.bfloat16] * 3


def test_replica_threads_see_no_grad_and_inference_mode(strategy):
    with torch.no_grad():
        assert not any(s["grad"] for s in _per_replica(strategy))
    with torch.inference_mode():
        assert all(s["inference"] and not s["grad"] for s in _per_replica(strategy))
    seen = _per_replica(strategy)  # and nothing is left behind on the pool's threads
    assert all(s["grad"] and not s["inference"] and not s["autocast"] for s in seen), seen


def test_replica_threads_see_the_callers_saved_tensor_hooks(strategy):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert all(s["hooks"] for s in _per_replica(strategy))
    assert not any(s["hooks"] for s in _per_replica(strategy))


def test_capture_and_applied_carry_the_state_to_a_plain_thread():
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        state = capture()
    seen: list[dict] = []

    def body() -> None:
        with applied(state):
            seen.append(_seen())
        seen.append(_seen())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    inside, after = seen
    assert inside["autocast"] and inside["dtype"] == torch.float16 and not inside["grad"]
    assert not after["autocast"] and after["grad"]
