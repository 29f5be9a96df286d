import pytest
import torch

from spread.data.batches import inputs_and_targets


def test_pairs_and_xy_dicts_give_inputs_and_targets():
    x, y = torch.zeros(3, 2), torch.ones(3)
    for batch in ((x, y), [x, y], {"x": x, "y": y, "weights": y}):
        got_x, got_y = inputs_and_targets(batch, who="Trainer")
        assert got_x is x and got_y is y


@pytest.mark.parametrize("batch", [torch.zeros(3), (torch.zeros(3),), {"input_ids": torch.zeros(3)}])
def test_other_shapes_are_refused_naming_the_caller(batch):
    with pytest.raises(TypeError, match=r"^PipelineStrategy expects batches of \(inputs, targets\)"):
        inputs_and_targets(batch, who="PipelineStrategy")
