"""Activation offload: the saved-tensor hooks run, and training gives the same weights."""

from __future__ import annotations

import pytest
import torch
from _tiny_gpt import batches, fresh, lm_loss, max_difference, train

from spread.memory import (
    OffloadActivations,
    checkpoint_blocks,
    is_checkpointed,
    offload_module,
    remove_checkpointing,
    remove_offload,
)


def test_hooks_run_and_gradients_equal_on_cpu():
    model = fresh(dropout=0.0)
    ids = batches(1)[0]
    lm_loss(model, ids).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with OffloadActivations(keep=model.parameters()) as hooks:
        loss = lm_loss(model, ids)
    assert hooks.saved > 0 and hooks.restored == 0
    loss.backward()
    assert hooks.restored > 0  # every saved tensor that backward used came back through unpack
    assert hooks.offloaded == hooks.offloaded_bytes == 0  # on a CPU nothing moves
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))


def test_offloaded_training_equals_plain_training():
    reference = train(fresh())
    model = fresh()
    hooks = offload_module(model)
    assert max_difference(train(model), reference) <= 1e-6
    assert hooks.saved > 0 and hooks.restored > 0
    assert remove_offload(model) == 1 and "forward" not in model.__dict__


def test_offload_and_checkpointing_compose():
    reference = train(fresh())
    model = fresh()
    checkpoint_blocks(model, every=1)
    hooks = offload_module(model)
    assert max_difference(train(model), reference) <= 1e-6
    assert hooks.saved > 0
    assert remove_checkpointing(model) == 4 and remove_offload(model) == 1
    assert not any(is_checkpointed(m) for m in model.modules())


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_bytes"):
        OffloadActivations(min_bytes=-1)
    model = fresh()
    offload_module(model)
    with pytest.raises(ValueError, match="already offloads"):
        offload_module(model)
