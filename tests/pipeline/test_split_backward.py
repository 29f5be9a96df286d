"""The split backward: input pass + weight pass give exactly the gradients of one ordinary backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from spread.pipeline.split_backward import SplitBackward


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.relu(self.layer(x)))


class TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class UsedFunctionally(nn.Module):
    """Its own ``scale``, and its child's weight used again outside the child."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.a(x) * self.scale, self.a.weight)


class SideBranch(nn.Module):
    """An embedding whose output never leads to the stage input: the input pass does not reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.layer = nn.Embedding(4, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x + self.pos(torch.arange(x.shape[-2]) % 4))


MODELS = {
    "mlp, in-place relu, layernorm": lambda: nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 8)
    ),
    "module called twice": lambda: nn.Sequential(CalledTwice(), nn.Linear(8, 8)),
    "tied weights": lambda: nn.Sequential(TiedPair(), nn.Linear(8, 8)),
    "weight used functionally": lambda: nn.Sequential(UsedFunctionally(), nn.ReLU()),
    "side branch": lambda: nn.Sequential(SideBranch(), nn.Linear(8, 8)),
    "transformer layer": lambda: nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    ),
}
# How many parameters the weight pass may not split (their gradient comes from one root run).
UNSPLIT = {
    "mlp, in-place relu, layernorm": 0,
    "module called twice": 2,  # the twice-called layer's weight and bias
    "tied weights": 1,  # the tied weight (each bias is used once)
    "weight used functionally": 1,  # the child's weight, used again above it (its bias and scale split)
    "side branch": 0,  # the embedding, reached off the input part from the sum
    "transformer layer": 0,  # MultiheadAttention's functional use of out_proj is one use
}


@pytest.mark.parametrize("name", list(MODELS))
def test_split_backward_equals_one_backward(name):
    torch.manual_seed(0)
    reference = MODELS[name]()
    model = copy.deepcopy(reference)
    x = torch.randn(6, 5, 8)
    micro = [slice(0, 3), slice(3, 6)]

    plain_input = x.clone().requires_grad_(True)
    for part in micro:  # two micro-batches, ordinary backward each
        reference(plain_input[part]).pow(2).mean().backward()

    split = SplitBackward(model)
    pending = []
    unsplit = []
    for part in micro:
        stage_input = x[part].clone().requires_grad_(True)
        loss = model(stage_input).pow(2).mean()
        graph = split.backward_input(loss, None, stage_input)
        pending.append((graph, stage_input))
        unsplit.append(len(graph.rest))
    # The input pass leaves every weight alone; the input gradients are already final.
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.cat([s.grad for _, s in pending]), plain_input.grad)
    for graph, _ in pending:  # weight passes later, both micro-batches
        split.backward_weight(graph)
        assert not graph.entries and not graph.roots  # the graph is released

    assert unsplit == [UNSPLIT[name]] * 2
    for (key, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7, msg=key)
    split.close()


def test_the_input_pass_skips_the_weight_products():
    """Half of a linear stack's backward FLOPs are input gradients, half weight gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(4)])
    split = SplitBackward(model)
    x = torch.randn(32, 64, requires_grad=True)
    loss = model(x).sum()
    with FlopCounterMode(display=False) as input_pass:
        graph = split.backward_input(loss, None, x)
    with FlopCounterMode(display=False) as weight_pass:
        split.backward_weight(graph)
    one_product = 2 * 32 * 64 * 64
    assert input_pass.get_total_flops() == 4 * one_product
    assert weight_pass.get_total_flops() == 4 * one_product


def test_no_stage_input_gradient_leaves_everything_to_the_weight_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)  # the first stage: data, no gradient wanted
    reference(x).sum().backward()
    split = SplitBackward(model)
    loss = model(x).sum()
    graph = split.backward_input(loss, None, None)
    assert all(p.grad is None for p in model.parameters())
    split.backward_weight(graph)
    for want, got in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_weight_pass_exchanges_once_after_its_last_engine_call():
    """Hybrid: the gradient exchange hangs off the end of a backward; with one engine call per
    module, every call but the last must run inside ``no_sync``."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    split = SplitBackward(model)
    x = torch.randn(4, 8, requires_grad=True)
    loss = model(x).sum()
    graph = split.backward_input(loss, None, x)
    synced: list[bool] = []
    inside = [False]

    class NoSync:
        def __enter__(self):
            inside[0] = True

        def __exit__(self, *exc):
            inside[0] = False

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: synced.append(not inside[0]))
    split.backward_weight(graph, NoSync)
    # Outside no_sync only at the end: the last call's parameters, after every other one's.
    assert synced[-1] and False in synced and synced == sorted(synced)


def test_checkpointed_modules_stay_correct_and_warn_about_the_recomputation():
    from spread.memory import checkpoint_stage

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    reference(x.requires_grad_(True)).sum().backward()
    checkpoint_stage(model)
    split = SplitBackward(model)
    stage_input = x.detach().requires_grad_(True)
    loss = model(stage_input).sum()
    graph = split.backward_input(loss, None, stage_input)
    with pytest.warns(RuntimeWarning, match="recomputing checkpointed activations"):
        split.backward_weight(graph)
    torch.testing.assert_close(stage_input.grad, x.grad)
    for want, got in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_a_graph_that_changes_between_micro_batches_is_checked_again():
    """The second micro-batch reuses a layer's weight outside the layer; the first does not."""

    class Sometimes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)
            self.reuse = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.layer(x)
            return nn.functional.linear(out, self.layer.weight) if self.reuse else out

    torch.manual_seed(0)
    model = nn.Sequential(Sometimes(), nn.Tanh())
    reference = copy.deepcopy(model)
    parts = [torch.randn(3, 8), torch.randn(3, 8)]
    for reuse, part in zip((False, True), parts, strict=True):
        reference[0].reuse = reuse
        reference(part.requires_grad_(True)).sum().backward()
    split = SplitBackward(model)
    for reuse, part in zip((False, True), parts, strict=True):
        model[0].reuse = reuse
        stage_input = part.detach().requires_grad_(True)
        loss = model(stage_input).sum()
        graph = split.backward_input(loss, None, stage_input)
        assert (len(graph.rest) == 1) is reuse  # the reused weight goes to the root run
        split.backward_weight(graph)
    for want, got in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
