"""CentralStorageStrategy: one copy of the variables, replicas on threads, one update per step."""

from __future__ import annotations

import pytest
import torch
from _equivalence_cases import GLOBAL_BATCH, make_data, make_model, max_relative_difference
from torch import nn

import spread
from spread.errors import SpreadError
from spread.strategies import make_strategy

TOLERANCE = 1e-5


def fit(strategy) -> tuple[dict[str, torch.Tensor], dict]:
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"])
    history = trainer.fit(make_data(), epochs=2, global_batch_size=GLOBAL_BATCH, seed=3, verbose=0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, history.history


def test_trainer_fit_equals_one_device():
    reference, ref_history = fit(spread.OneDeviceStrategy("cpu"))
    strategy = spread.CentralStorageStrategy(num_replicas=3, intra_op_threads=1)
    try:
        weights, history = fit(strategy)
    finally:
        strategy.close()
    assert max_relative_difference(weights, reference) <= TOLERANCE
    assert history.keys() == ref_history.keys()
    for name, values in history.items():
        assert values == pytest.approx(ref_history[name], rel=1e-5), name


def test_one_copy_of_the_variables_on_the_parameter_device():
    strategy = make_strategy("central_storage", num_replicas=2, intra_op_threads=1)
    try:
        assert isinstance(strategy, spread.CentralStorageStrategy)
        assert strategy.parameter_device == torch.device("cpu")
        assert strategy.compute_devices == (torch.device("cpu"),) * 2
        assert strategy.num_replicas_in_sync == 2
        with strategy.scope():
            model = make_model()
        x, y = make_data()
        seen = []

        def step(x, y):
            # every replica reads the same (central) parameter tensors
            seen.append({id(p) for p in model.parameters()})
            nn.functional.cross_entropy(model(x), y).backward()
            return torch.tensor(float(len(y)))

        dataset = strategy.distribute_dataset((x, y), GLOBAL_BATCH)
        batch = next(iter(dataset))
        total = strategy.reduce("sum", strategy.run(step, args=batch))
        assert float(total) == GLOBAL_BATCH
        assert len(seen) == 2 and seen[0] == seen[1] == {id(p) for p in model.parameters()}
        assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters())
    finally:
        strategy.close()


def test_variables_away_from_the_compute_device_are_refused_with_the_reason():
    with pytest.raises(SpreadError, match=r"parameter_device='cuda'.*not built"):
        spread.CentralStorageStrategy(num_replicas=2, parameter_device="cuda", intra_op_threads=1)
