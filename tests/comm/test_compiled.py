"""Compiled graphs cut at bucket boundaries: gradients ready piece by piece, not all at the end."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spread.comm.compiled import bucket_graph_breaks, compiled_kind

MB = 2**20


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # every test compiles afresh (cached graphs would skip the split)
    yield
    torch._dynamo.reset()


def _model() -> nn.Module:
    """Three 1 MB layers: with a 1 MB cap, three pieces."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))


def _compiled_backward_nodes(loss: torch.Tensor) -> int:
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += "CompiledFunctionBackward" in node.name()
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return count


def _ready_order(model: nn.Module, compiled: nn.Module) -> tuple[list[str], int]:
    """Parameter names in the order their gradients became ready, and the compiled backward nodes."""
    order: list[str] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
        for name, p in model.named_parameters()
    ]
    x = torch.randn(8, 512)
    loss = compiled(x).square().mean()
    nodes = _compiled_backward_nodes(loss)
    loss.backward()
    for h in handles:
        h.remove()
    return order, nodes


@pytest.mark.slow
def test_a_graph_compiled_inside_is_cut_so_the_last_layers_are_ready_first():
    model = _model()
    compiled = torch.compile(model)
    with bucket_graph_breaks(1 * MB):
        compiled(torch.randn(8, 512)).sum().backward()  # compiles here, inside the block
    model.zero_grad()
    order, nodes = _ready_order(model, compiled)  # later calls reuse the cut graph
    assert nodes == 3
    assert order.index("4.weight") < order.index("2.weight") < order.index("0.weight")


@pytest.mark.slow
def test_a_graph_compiled_outside_stays_one_backward_node():
    model = _model()
    compiled = torch.compile(model)
    _, nodes = _ready_order(model, compiled)
    assert nodes == 1  # the problem the split solves: every gradient comes out of one node, at the end


@pytest.mark.slow
def test_the_cut_graph_computes_the_same_gradients_as_eager():
    model = _model()
    x = torch.randn(8, 512)
    model(x).square().mean().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with bucket_graph_breaks(1 * MB):
        torch.compile(model)(x).square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_caps_below_one_megabyte_are_raised_to_torchs_first_bucket():
    # DDPOptimizer asserts that its first (1 MB) piece is no larger than the cap; spread's tests and
    # users use tiny buckets, which must not break compilation.
    model = _model()
    with bucket_graph_breaks(100):
        torch.compile(model)(torch.randn(8, 512)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_slot_is_restored_even_on_error():
    outer = object()
    DistributedDataParallel._active_ddp_module = outer  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="boom"), bucket_graph_breaks(MB):
            assert DistributedDataParallel._get_active_ddp_module().bucket_bytes_cap == MB
            raise RuntimeError("boom")
        assert DistributedDataParallel._active_ddp_module is outer
    finally:
        DistributedDataParallel._active_ddp_module = None


def test_a_non_positive_cap_is_refused():
    with pytest.raises(ValueError, match="bucket_cap_bytes must be positive, got 0"), bucket_graph_breaks(0):
        pass


def test_compiled_kind_tells_the_wrapper_from_in_place_compilation():
    plain = nn.Linear(2, 2)
    assert compiled_kind(plain) is None
    assert compiled_kind(torch.compile(plain)) == "torch.compile"
    in_place = nn.Linear(2, 2)
    in_place.compile()  # lazy: nothing is compiled until the first call
    assert compiled_kind(in_place) == "module.compile()"
