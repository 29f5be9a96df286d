"""The state seam: ``strategy.save_checkpoint``/``load_checkpoint``/``full_state_dict`` on every path.

Custom loops save ``{"model", "optimizer", "data", "step"}`` and resume at another world size and
under another synchronous data-parallel strategy, equal to the uninterrupted run; the Trainer's
backups do the same (MultiWorkerMirrored to Sharded and back); plain objects and values come back
in place; what does not fit is refused before anything is overwritten.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import spread
from spread.errors import CheckpointMismatchError
from spread.strategies.checkpointing import FORMAT_KEY
from spread.testing.processes import spread_run

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # the same sums, split and added in another order

# A custom loop as people write one: a model that is not nn.Sequential, AdamW, a checkpoint every few
# steps, a crash where it happens to be (an exception on every rank, mid-epoch), no close().
CUSTOM_LOOP = r"""
import json, sys
import torch
from torch import nn
import spread

ckpt_dir, kind, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "mwms":
    strategy = spread.MultiWorkerMirroredStrategy()
else:
    strategy = spread.ShardedStrategy(shard=kind.removeprefix("sharded-"))


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.embed(x))))


g = torch.Generator().manual_seed(1)
x, y = torch.randn(120, 8, generator=g), torch.randint(0, 3, (120,), generator=g)
with strategy.scope():
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
data = strategy.distribute_dataset((x, y), global_batch_size=24, seed=3)
loss_fn = nn.CrossEntropyLoss()

state = {"model": model, "optimizer": optimizer, "data": data, "step": 0}
restored = strategy.load_checkpoint(ckpt_dir, state)
step = state["step"]
first_epoch = data.state_dict()["epoch"] if restored else 0


def train_step(xb, yb):
    loss = loss_fn(model(xb), yb)
    loss.backward()
    return loss


losses = []
for epoch in range(first_epoch, 4):
    if restored is None or epoch != first_epoch:
        data.set_epoch(epoch)
    for xb, yb in data:
        optimizer.zero_grad()
        loss = strategy.reduce("mean", strategy.run(train_step, args=(xb, yb)))
        optimizer.step()
        step += 1
        losses.append(float(loss))
        if step % 4 == 0:
            strategy.save_checkpoint(
                ckpt_dir, {"model": model, "optimizer": optimizer, "data": data, "step": step}, step=step
            )
        if step == crash_at:
            raise RuntimeError(f"simulated crash after step {step}")
weights = strategy.full_state_dict(model)
if strategy.is_chief:
    print("RESULT " + json.dumps({
        "restored": None if restored is None else restored.step,
        "steps": step,
        "world": strategy.num_replicas_in_sync,
        "weights": {k: v.flatten().tolist() for k, v in weights.items()},
    }), flush=True)
"""


def _custom_loop(tmp_path: Path, nproc: int, ckpt: Path, kind: str, crash_at: int = 0):
    script = tmp_path / "custom_loop.py"
    script.write_text(CUSTOM_LOOP)
    return spread_run(script, nproc, str(ckpt), kind, str(crash_at))


def _assert_same_weights(result: dict, reference: dict) -> None:
    for key, values in reference["weights"].items():
        torch.testing.assert_close(
            torch.tensor(result["weights"][key]), torch.tensor(values), **TOLERANCE, msg=key
        )


@pytest.mark.processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("saved_as", "resumed_as", "resumed_at"),
    [
        ("mwms", "mwms", 3),
        ("sharded-parameters", "sharded-parameters", 3),
        ("mwms", "sharded-parameters", 2),  # a job that ran out of memory continues sharded
        ("sharded-parameters", "mwms", 2),  # and back
    ],
)
def test_a_custom_loop_saved_at_2_processes_resumes_elsewhere_equal_to_the_uninterrupted_run(
    tmp_path, saved_as, resumed_as, resumed_at
):
    reference = _custom_loop(tmp_path, 2, tmp_path / "ref", "mwms")
    assert reference.returncode == 0 and reference.result is not None, reference.log[-3000:]
    ckpt = tmp_path / "ckpt"
    crashed = _custom_loop(tmp_path, 2, ckpt, saved_as, crash_at=11)  # mid-epoch 3, after step 8's save
    assert crashed.returncode != 0 and "simulated crash after step 11" in crashed.log, crashed.log[-3000:]
    assert (ckpt / "ckpt-0000000008").is_dir()
    resumed = _custom_loop(tmp_path, resumed_at, ckpt, resumed_as)
    assert resumed.returncode == 0 and resumed.result is not None, resumed.log[-3000:]
    assert resumed.result["restored"] == 8 and resumed.result["world"] == resumed_at
    assert resumed.result["steps"] == reference.result["steps"] == 20
    _assert_same_weights(resumed.result, reference.result)


@pytest.mark.processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("saved_as", "resumed_as"), [("mwms", "sharded-parameters"), ("sharded-gradients", "mwms")]
)
def test_a_trainer_backup_resumes_under_another_data_parallel_strategy(tmp_path, saved_as, resumed_as):
    """BackupAndRestore's backups: MultiWorkerMirrored to Sharded and back, equal to uninterrupted."""
    script = Path(__file__).parents[1] / "train" / "scripts" / "elastic_train.py"
    reference = spread_run(script, 2, str(tmp_path / "ref"), "0", saved_as)
    assert reference.returncode == 0 and reference.result is not None, reference.log[-3000:]
    backup = tmp_path / "backup"
    crashed = spread_run(script, 2, str(backup), "11", saved_as)  # rank 1 SIGKILLed after step 11
    assert crashed.returncode != 0 and (backup / "ckpt-0000000009").is_dir(), crashed.log[-3000:]
    resumed = spread_run(script, 2, str(backup), "0", resumed_as)
    assert resumed.returncode == 0 and resumed.result is not None, resumed.log[-3000:]
    assert resumed.result["restored"] == 9
    _assert_same_weights(resumed.result, reference.result)
    assert resumed.result["loss"] == pytest.approx(reference.result["loss"], rel=1e-4)


# -- one process: plain objects, values, refusals ------------------------------------------------------
class _Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state) -> None:
        self.count = int(state["count"])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def test_a_state_round_trips_in_place(tmp_path):
    strategy = spread.OneDeviceStrategy("cpu")
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    counter = _Counter()
    counter.count = 7
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    strategy.save_checkpoint(
        tmp_path, {"model": model, "optimizer": optimizer, "counter": counter, "step": 5}, step=5
    )

    fresh = _model()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh_counter = _Counter()
    state = {"model": fresh, "optimizer": fresh_optimizer, "counter": fresh_counter, "step": 0}
    restored = strategy.load_checkpoint(tmp_path, state)
    assert restored is not None and restored.step == 5 and restored.resume_step == 5
    assert state["step"] == 5 and fresh_counter.count == 7
    for key, value in saved.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1


def test_no_checkpoint_is_none_and_changes_nothing(tmp_path):
    strategy = spread.OneDeviceStrategy("cpu")
    state = {"step": 3}
    assert strategy.load_checkpoint(tmp_path / "nothing", state) is None and state == {"step": 3}


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_changes(tmp_path):
    strategy = spread.OneDeviceStrategy("cpu")
    model = _model()
    strategy.save_checkpoint(tmp_path, {"model": model, "step": 1}, step=1)
    other = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    counter = _Counter()
    state = {"model": other, "counter": counter, "step": 0}
    with pytest.raises(CheckpointMismatchError) as info:
        strategy.load_checkpoint(tmp_path, state)
    assert "model: '2.weight': saved (2, 6) float32, expected (3, 6) float32" in info.value.problems
    assert any("missing stateful 'counter'" in p for p in info.value.problems)
    assert "ckpt-0000000001" in str(info.value)
    assert state["step"] == 0
    for key, value in before.items():
        assert torch.equal(other.state_dict()[key], value), key


def test_bad_input_gets_a_clear_error(tmp_path):
    strategy = spread.OneDeviceStrategy("cpu")
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        strategy.save_checkpoint(tmp_path, {"step": 1}, step=-1)
    with pytest.raises(ValueError, match="without '/'"):
        strategy.save_checkpoint(tmp_path, {"a/b": 1}, step=1)
    with pytest.raises(TypeError, match="mapping of names"):
        strategy.save_checkpoint(tmp_path, [("step", 1)], step=1)  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt-0000000001").exists()


def test_a_checkpoint_of_an_older_format_is_refused_naming_it(tmp_path):
    from spread.checkpoint import CheckpointManager

    CheckpointManager(tmp_path).save(4, {"model": {}, "global_step": 4, "history": {}})  # format 1
    with pytest.raises(CheckpointMismatchError, match="checkpoint format 1"):
        spread.OneDeviceStrategy("cpu").load_checkpoint(tmp_path, {"step": 0})
    saved = torch.load(tmp_path / "ckpt-0000000004" / "state.pt", weights_only=True)
    assert FORMAT_KEY not in saved  # and it is left as it was


def test_full_state_dict_of_a_model_and_its_optimizer_loads_into_one_device(tmp_path):
    strategy = spread.MirroredStrategy(num_replicas=2, intra_op_threads=1)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    try:
        x = torch.randn(8, 4)

        def step(xb):
            model(xb).sum().backward()

        strategy.run(step, args=(x,))
        optimizer.step()
        weights, moments = strategy.full_state_dict(model), strategy.full_state_dict(optimizer)
        one = _model()
        one.load_state_dict(weights)
        one_optimizer = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9)
        one_optimizer.load_state_dict(moments)
        assert one_optimizer.state_dict()["state"][0]["momentum_buffer"].shape == (6, 4)
    finally:
        strategy.close()
