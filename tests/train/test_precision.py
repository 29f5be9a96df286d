"""Trainer(precision=...): bf16 and fp16 autocast on every replica (threads included), float32
parameters and gradients, the fp16 loss scaler skipping overflowed steps without calling them
failures, strategies that cannot train in fp16 refusing it by name."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import spread
from spread.cluster import ClusterSpec
from spread.train.precision import Precision, check_precision

N, BATCH = 48, 12


def _data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, 6, generator=g)
    return x, (x[:, 0] - x[:, 1] > 0).long()


class DtypeProbe(nn.Module):
    """Records the dtype its Linear computes in, per thread (replica)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)
        self.seen: set[torch.dtype] = set()

    def forward(self, x):
        h = self.body(x)
        self.seen.add(h.dtype)
        return self.head(h)


def _trainer(strategy, precision: str, **kwargs):
    with strategy.scope():
        torch.manual_seed(0)
        model = DtypeProbe()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return spread.Trainer(
        model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, precision=precision, **kwargs
    )


STRATEGIES = {
    "one_device": lambda: spread.OneDeviceStrategy("cpu"),
    "mirrored": lambda: spread.MirroredStrategy(num_replicas=3, intra_op_threads=1),
    "central_storage": lambda: spread.CentralStorageStrategy(num_replicas=2, intra_op_threads=1),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_every_replica_computes_in_the_chosen_dtype_with_float32_weights(name, precision, dtype):
    strategy = STRATEGIES[name]()
    try:
        trainer = _trainer(strategy, precision)
        history = trainer.fit(_data(), epochs=2, global_batch_size=BATCH, verbose=0)
        evaluation = trainer.evaluate(_data())
        predictions = trainer.predict(_data()[0])
    finally:
        strategy.close()
    assert trainer.model.seen == {dtype}  # no replica fell back to float32
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert set(evaluation) == {"loss"}
    assert predictions.dtype == torch.float32 and predictions.shape == (N, 2)


def test_precision_32_changes_nothing():
    trainer = _trainer(spread.OneDeviceStrategy("cpu"), "32")
    trainer.fit(_data(), epochs=1, global_batch_size=BATCH, verbose=0)
    assert trainer.model.seen == {torch.float32}
    assert (
        trainer.precision.scaler is None and not {"grad_scaler", "lr_scheduler"} & trainer.state_dict().keys()
    )


def test_fp16_overflow_is_skipped_by_the_scaler_not_raised():
    trainer = _trainer(spread.OneDeviceStrategy("cpu"), "fp16", on_nonfinite="raise", clip_grad_norm=1.0)
    assert trainer.precision.scaler is not None
    trainer.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)  # overflows at first
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    seen_norms: list[float] = []

    class Record(spread.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            seen_norms.append(logs["grad_norm"])
            if len(seen_norms) == 1:  # the first step overflowed: skipped, the weights untouched
                for k, v in trainer.model.state_dict().items():
                    assert torch.equal(v, before[k]), k

    trainer.fit(_data(), epochs=8, global_batch_size=BATCH, verbose=0, callbacks=[Record()])
    assert trainer.scaler_skipped_steps >= 1 and trainer.skipped_steps == 0
    assert trainer.global_step == 8 * N // BATCH  # a scaler skip still counts as a training step
    assert trainer.precision.scaler.get_scale() < 2.0**30
    assert not math.isfinite(seen_norms[0]) and math.isfinite(seen_norms[-1])
    state = trainer.state_dict()["grad_scaler"]
    assert state["scale"] == trainer.precision.scaler.get_scale()


def test_the_scaler_state_round_trips():
    a = Precision("fp16", torch.device("cpu"))
    b = Precision("fp16", torch.device("cpu"))
    assert a.scaler is not None and b.scaler is not None
    b.load_state_dict({**a.state_dict(), "scale": 128.0, "_growth_tracker": 7})
    assert b.state_dict()["scale"] == 128.0 and b.state_dict()["_growth_tracker"] == 7
    b.load_state_dict({})  # a backup of a run without a scaler leaves it as it is
    assert b.scaler.get_scale() == 128.0


def _ps_spec() -> ClusterSpec:
    cluster = {"chief": ["127.0.0.1:2"], "ps": ["127.0.0.1:1"]}
    return ClusterSpec(role="chief", task_index=0, rank=0, world_size=1, cluster=cluster, source="tf_config")


def test_fp16_is_refused_where_replicas_would_skip_steps_alone():
    strategy = spread.ParameterServerStrategy(cluster=_ps_spec())
    try:
        with pytest.raises(ValueError, match="ParameterServerStrategy does not train with precision='fp16'"):
            spread.Trainer(
                nn.Linear(2, 2),
                torch.optim.SGD([nn.Parameter(torch.zeros(1))]),
                nn.MSELoss(),
                strategy=strategy,
                precision="fp16",
            )
        strategy.check_precision("bf16")  # bf16 needs no loss scaling: allowed
    finally:
        strategy.close()


def test_bad_precision_is_refused_by_name():
    assert check_precision(32) == "32"
    for bad in ("16", "float16", "mixed", 16, True, None):
        with pytest.raises(ValueError, match="precision must be one of"):
            check_precision(bad)
    with pytest.raises(ValueError, match=r"precision=.bf32."):
        _trainer(spread.OneDeviceStrategy("cpu"), "bf32")
