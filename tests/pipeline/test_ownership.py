"""Stage ownership without processes: the first owner of a shared tensor, and the stale-state guard
(the tied-gradient sum needs processes: tests/strategies/test_pipeline_named_split.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spread.errors import SpreadError
from spread.pipeline.ownership import StaleStateGuard, first_owned


def two_stage_model() -> tuple[nn.Sequential, list[list[torch.Tensor]]]:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight  # tied across the stages
    stage_tensors = [list(model[0].parameters()), [model[1].weight, model[1].bias]]
    return model, stage_tensors


def test_a_tied_tensor_belongs_to_its_first_stage():
    model, stage_tensors = two_stage_model()
    owned = first_owned(stage_tensors)
    assert [len(o) for o in owned] == [2, 1]
    assert owned[1][0] is model[1].bias


def test_state_dict_refuses_while_stale_and_works_when_current():
    model, stage_tensors = two_stage_model()
    guard = StaleStateGuard(model, stage_tensors, stage=0, rank=0)
    full = model.state_dict()  # not stale yet (before any training step)
    guard.stale = True
    with pytest.raises(SpreadError, match=r"rank 0 \(pipeline stage 0\).*gather_state_dict"):
        model.state_dict()
    with pytest.raises(SpreadError, match="module '1'"):
        model[1].state_dict()  # the submodule holding stage 1's bias refuses too
    assert model[0].state_dict().keys() == {"weight", "bias"}  # this stage's own layer is current
    with guard.reading():
        assert model.state_dict().keys() == full.keys()
    model.load_state_dict(full)  # every rank loads the same full state: current again
    assert not guard.stale
    model.state_dict()
    guard.stale = True
    guard.remove()
    model.state_dict()  # the strategy closed: no guard


def test_a_single_stage_has_nothing_to_guard():
    model, _ = two_stage_model()
    guard = StaleStateGuard(model, [list(model.parameters())], stage=0, rank=0)
    guard.stale = True
    model.state_dict()
