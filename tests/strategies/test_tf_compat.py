"""Scripts translated from TensorFlow's tf.distribute tutorials run as their authors expect: the
global-batch loss convention (``compute_average_loss``), ``experimental_distribute_dataset`` of a
globally batched loader, ``distribute_datasets_from_function``, ``ReduceOp``,
``experimental_local_results`` and ``cluster_resolver``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import spread
from spread.testing import run_ranks

GLOBAL_BATCH_SIZE = 32
N = 160  # 5 global batches


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(N, 12, generator=g), torch.randint(0, 4, (N,), generator=g))


class Classifier(nn.Module):  # not nn.Sequential, as in the tutorial's subclassed model
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(12, 24)
        self.out = nn.Linear(24, 4)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def _tutorial_loop(strategy, *, tensorflow_helper: bool = True) -> tuple[dict, list[float]]:
    """TensorFlow's "Custom training with tf.distribute.Strategy", translated line by line."""
    with strategy.scope():
        torch.manual_seed(0)
        model = Classifier()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loss_object = nn.CrossEntropyLoss(reduction="none")

        def compute_loss(labels, predictions):
            per_example_loss = loss_object(predictions, labels)
            if tensorflow_helper:
                return spread.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
            return per_example_loss.sum() / GLOBAL_BATCH_SIZE  # what tf.nn.compute_average_loss computes

    train_dataset = DataLoader(_data(), batch_size=GLOBAL_BATCH_SIZE, shuffle=True)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)

    def train_step(inputs):
        images, labels = inputs
        predictions = model(images)
        loss = compute_loss(labels, predictions)
        loss.backward()
        return loss

    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(spread.ReduceOp.SUM, per_replica_losses, axis=None)

    losses = []
    for _ in range(2):
        for batch in train_dist_dataset:
            optimizer.zero_grad()
            losses.append(float(distributed_train_step(batch)))
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def test_the_tutorials_global_batch_loss_trains_as_one_device_with_compute_average_loss():
    reference, reference_losses = _tutorial_loop(spread.OneDeviceStrategy())
    weights, losses = _tutorial_loop(spread.MirroredStrategy(num_replicas=2))
    for key in reference:
        torch.testing.assert_close(weights[key], reference[key], rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(reference_losses, rel=1e-5)  # the reduced SUM is the global mean


def test_the_same_loss_written_by_hand_trains_at_half_the_gradient():
    """Why compute_average_loss exists: spread averages the replicas' gradients (TensorFlow sums
    them), so a loss divided by the global batch gives 1/N of the gradient."""
    reference, _ = _tutorial_loop(spread.OneDeviceStrategy(), tensorflow_helper=False)
    weights, _ = _tutorial_loop(spread.MirroredStrategy(num_replicas=2), tensorflow_helper=False)
    assert max((weights[k] - reference[k]).abs().max().item() for k in reference) > 1e-2


def test_compute_average_loss_value_and_weights():
    losses = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert spread.compute_average_loss(losses, global_batch_size=8).item() == pytest.approx(1.5)
    assert spread.compute_average_loss(losses).item() == pytest.approx(3.0)
    weighted = spread.compute_average_loss(losses, sample_weight=torch.tensor([1.0, 0.0, 0.0, 0.5]))
    assert weighted.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"takes per-example losses"):
        spread.compute_average_loss(losses.mean())


def test_datasets_from_function_feeds_one_per_replica_batch_to_each_replica():
    per_replica_seen = []

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)
        assert (input_context.num_input_pipelines, input_context.input_pipeline_id) == (1, 0)
        return DataLoader(_data(), batch_size=batch_size)

    strategy = spread.MirroredStrategy(num_replicas=2)
    dist_dataset = strategy.distribute_datasets_from_function(dataset_fn)
    for batch in dist_dataset:
        sizes = strategy.run(lambda b: torch.tensor(float(len(b[0]))), args=(batch,))
        per_replica_seen.append([float(v) for v in strategy.experimental_local_results(sizes)])
    assert per_replica_seen == [[16.0, 16.0]] * 5
    with pytest.raises(ValueError, match=r"not divisible by the 2 replicas"):
        spread.InputContext(1, 0, 2).get_per_replica_batch_size(33)


def test_experimental_distribute_dataset_wants_a_globally_batched_loader():
    with pytest.raises(TypeError, match=r"takes a DataLoader batched by the global batch size"):
        spread.OneDeviceStrategy().experimental_distribute_dataset(_data())


def test_one_process_has_no_cluster_resolver_as_in_tensorflow():
    assert spread.MirroredStrategy(num_replicas=2).cluster_resolver is None


def _resolver() -> tuple:
    strategy = spread.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    return resolver.task_type, resolver.task_id, strategy.rank


@pytest.mark.processes
def test_multi_worker_scripts_find_their_task_in_the_cluster_resolver():
    for task_type, task_id, rank in run_ranks(_resolver, 2, timeout=120):
        assert (task_type, task_id) == ("worker", rank)
