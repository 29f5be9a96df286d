"""scope() manages every parameter of the modules built in it, including layers that register
nothing because they are deep copies (nn.TransformerEncoder clones its layer)."""

from __future__ import annotations

import torch
from torch import nn

import spread


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Flatten(), nn.Linear(64, 3)
    )


def test_deep_copied_layers_built_in_the_scope_are_managed():
    strategy = spread.OneDeviceStrategy()
    with strategy.scope():
        model = _encoder()
    managed = {id(p) for p in strategy.managed_parameters}
    assert all(id(p) in managed for p in model.parameters())
    assert all(id(p) in managed for p in model[0].layers.parameters())


def test_a_module_built_in_the_scope_and_dropped_is_neither_managed_nor_kept_alive():
    """nn.TransformerEncoder's template layer: built, deep-copied, dropped. Managing it cost every
    rank its parameters (W2: 0.8 M floats) in memory, broadcasts and sharded state."""
    strategy = spread.OneDeviceStrategy()
    with strategy.scope():
        model = _encoder()
        scratch = nn.Linear(1000, 1000)
        del scratch
    assert len(strategy.managed_parameters) == len(list(model.parameters()))
    assert all(p.numel() != 1000 * 1000 for p in strategy.managed_parameters)


def _train(strategy: spread.Strategy, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 4, 16, generator=g), torch.randint(0, 3, (24,), generator=g)
    with strategy.scope():
        model = _encoder()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = strategy.distribute_dataset((x, y), global_batch_size=8, shuffle=False)

    def step(xb, yb):
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        return loss

    for xb, yb in dataset:
        optimizer.zero_grad()
        strategy.run(step, args=(xb, yb))
        optimizer.step()
    strategy.close()
    return [p.detach().clone() for p in model.parameters()]


def test_a_custom_loop_over_a_transformer_encoder_under_mirrored_equals_one_device():
    one = _train(spread.OneDeviceStrategy())
    two = _train(spread.MirroredStrategy(num_replicas=2, intra_op_threads=1))
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
