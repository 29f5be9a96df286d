"""Activation checkpointing changes memory, not results (dropout included)."""

from __future__ import annotations

import pytest
import torch
from _tiny_gpt import batches, fresh, lm_loss, max_difference, train
from torch import nn

from spread.memory import (
    SavedTensorBytes,
    checkpoint_blocks,
    checkpoint_chunks,
    checkpoint_module,
    is_checkpointed,
    remove_checkpointing,
)


def saved_bytes(model: nn.Module) -> int:
    with SavedTensorBytes(exclude=model.parameters()) as meter:
        loss = lm_loss(model, batches(1)[0])
    loss.backward()
    return meter.bytes


def test_checkpointed_training_equals_plain_training_with_dropout():
    reference = train(fresh())
    model = fresh()
    assert checkpoint_blocks(model, every=1) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert max_difference(train(model), reference) <= 1e-6
    # the dropout masks matter: a different seed gives different weights, so the test can fail
    assert max_difference(train(fresh(), seed=43), reference) > 1e-4


def test_checkpointing_reduces_saved_activation_bytes():
    plain = saved_bytes(fresh())
    model = fresh()
    checkpoint_blocks(model, every=1)
    checkpointed = saved_bytes(model)
    assert 0 < checkpointed < plain / 2
    model_half = fresh()
    checkpoint_blocks(model_half, every=2)
    assert checkpointed < saved_bytes(model_half) < plain


def test_checkpoint_a_pipeline_stage_as_a_whole():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 16))
    x = torch.randn(32, 16, requires_grad=True)

    def grads() -> list[torch.Tensor]:
        stage.zero_grad()
        x.grad = None
        torch.manual_seed(1)
        with SavedTensorBytes(exclude=stage.parameters()) as meter:
            out = stage(x).square().sum()
        out.backward()
        return [x.grad.clone(), *(p.grad.clone() for p in stage.parameters())], meter.bytes

    plain, plain_bytes = grads()
    assert checkpoint_module(stage) is stage and is_checkpointed(stage)
    again, ck_bytes = grads()
    assert all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))
    assert ck_bytes < plain_bytes


def test_state_dict_and_eval_unchanged_and_removable():
    model = fresh()
    keys = list(model.state_dict())
    names = checkpoint_blocks(model, blocks=["layers.1", model.layers[3]])
    assert names == ["layers.1", "layers.3"]
    assert list(model.state_dict()) == keys
    assert [is_checkpointed(layer) for layer in model.layers] == [False, True, False, True]
    model.eval()
    with torch.no_grad():
        ids = batches(1)[0]
        out = model(ids)
    assert remove_checkpointing(model) == 2
    assert "forward" not in model.layers[1].__dict__
    with torch.no_grad():
        assert torch.equal(model(ids), out)


def test_blocks_by_type():
    model = fresh()
    assert checkpoint_blocks(model, blocks=nn.TransformerEncoderLayer) == [f"layers.{i}" for i in range(4)]
    assert checkpoint_blocks(model, blocks=model.layers) == [f"layers.{i}" for i in range(4)]  # idempotent


def test_bad_arguments_are_named():
    model = fresh()
    with pytest.raises(ValueError, match="exactly one"):
        checkpoint_blocks(model)
    with pytest.raises(ValueError, match="exactly one"):
        checkpoint_blocks(model, blocks=["layers.0"], every=2)
    with pytest.raises(ValueError, match="every must be"):
        checkpoint_blocks(model, every=0)
    with pytest.raises(ValueError, match=r"layers\.9"):
        checkpoint_blocks(model, blocks=["layers.9"])
    with pytest.raises(ValueError, match="not part of the model"):
        checkpoint_blocks(model, blocks=[nn.Linear(1, 1)])
    with pytest.raises(ValueError, match="no such submodule"):
        checkpoint_blocks(model, blocks=nn.Conv2d)
    with pytest.raises(TypeError, match="blocks items"):
        checkpoint_blocks(model, blocks=[3])
    with pytest.raises(ValueError, match="name the blocks"):
        checkpoint_blocks(nn.Linear(2, 2), every=1)


def test_checkpoint_chunks_gives_the_same_gradients_and_keeps_less():
    torch.manual_seed(0)
    weight = torch.randn(50, 8, requires_grad=True)
    h = torch.randn(40, 8, requires_grad=True)
    targets = torch.randint(0, 50, (40,))

    def loss_sum(h_part, t_part):
        return nn.functional.cross_entropy(h_part @ weight.T, t_part, reduction="sum")

    def run(chunks):
        weight.grad = h.grad = None
        with SavedTensorBytes(exclude=[weight, h]) as meter:
            total = (
                loss_sum(h, targets)
                if chunks is None
                else sum(checkpoint_chunks(loss_sum, h, targets, chunks=chunks))
            )
        total.backward()
        return total.detach(), weight.grad.clone(), h.grad.clone(), meter.bytes

    plain = run(None)
    chunked = run(3)  # 14 + 14 + 12 rows
    for a, b in zip(plain[:3], chunked[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert chunked[3] < plain[3]
    with pytest.raises(ValueError, match="chunks must be"):
        checkpoint_chunks(loss_sum, h, targets, chunks=0)
    with pytest.raises(ValueError, match="disagree"):
        checkpoint_chunks(loss_sum, h, targets[:5], chunks=2)
