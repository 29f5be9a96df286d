"""``spread plan script.py`` runs scripts as ``python script.py`` would, whatever strategy they build."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from spread.plan.capture import CaptureError, capture_script
from spread.plan.workload import measure_model


def _write_script_with_a_module_beside_it(folder, strategy: str) -> str:
    (folder / "plan_capture_helper_model.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            class SmallCNN(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.conv = nn.Conv2d(1, 4, 3, padding=1)
                    self.head = nn.Linear(4, 10)

                def forward(self, x):
                    return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))
            """
        )
    )
    script = folder / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            from torch import nn

            import spread
            from plan_capture_helper_model import SmallCNN

            strategy = spread.{strategy}()
            with strategy.scope():
                model = SmallCNN()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = torch.randn(96, 1, 8, 8), torch.randint(0, 10, (96,))
            trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
            trainer.fit(torch.utils.data.TensorDataset(x, y), epochs=1, global_batch_size=32)
            raise AssertionError("spread plan must stop the script at fit")
            """
        )
    )
    return str(script)


@pytest.mark.parametrize("strategy", ["OneDeviceStrategy", "MultiWorkerMirroredStrategy"])
def test_a_script_importing_a_module_beside_it_is_captured_at_fit(tmp_path, strategy):
    path = _write_script_with_a_module_beside_it(tmp_path, strategy)
    search_path = list(sys.path)
    try:
        workload = capture_script(path)
    finally:
        sys.modules.pop("plan_capture_helper_model", None)
    assert type(workload.model).__name__ == "SmallCNN" and workload.global_batch == 32
    assert tuple(workload.inputs.shape) == (32, 1, 8, 8) and workload.optimizer is not None
    assert sys.path == search_path  # the script's folder is on the path only while it runs
    assert not torch.distributed.is_initialized()  # a strategy the script left open is released


def test_a_script_that_never_calls_fit_gets_a_clear_error(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text("print('custom loop')\n")
    with pytest.raises(CaptureError, match=r"finished without calling spread\.Trainer\.fit"):
        capture_script(str(script))


def test_a_script_whose_strategy_needs_several_processes_is_told_to_give_a_factory(tmp_path):
    """A pipeline script cannot build its strategy in the one process spread plan runs it in."""
    script = tmp_path / "pipeline_train.py"
    script.write_text(
        textwrap.dedent(
            """
            import spread
            strategy = spread.PipelineStrategy(stages=2, microbatches=4)
            raise AssertionError("unreachable: the strategy refuses one process")
            """
        )
    )
    with pytest.raises(CaptureError, match=r"as one process, but its strategy needs 2 processes.*--model"):
        capture_script(str(script))
    assert not torch.distributed.is_initialized()


def test_a_torchrun_script_that_sets_up_torch_distributed_itself_is_told_to_give_a_factory(tmp_path):
    """The DDP tutorial's script calls init_process_group("gloo") from the environment, which one
    process without RANK cannot do; the error keeps torch's reason and says what to do instead."""
    script = Path(__file__).parents[1] / "cluster" / "scripts" / "ddp_tutorial.py"
    snapshot = str(tmp_path / "snapshot.pt")
    with pytest.raises(CaptureError, match=r"raised ValueError .*RANK(.|\n)*--model module:function"):
        capture_script(str(script), ["1", "1", "--snapshot", snapshot])
    assert not torch.distributed.is_initialized()


_HF_SCRIPT = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import spread

VOCAB = 64
ids = torch.randint(0, VOCAB, (64, 16), generator=torch.Generator().manual_seed(0))
data = [{{"input_ids": row, "labels": row}} for row in ids]
strategy = spread.OneDeviceStrategy()
with strategy.scope():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


def on_logits(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


trainer = spread.Trainer(model, optimizer, loss_fn={loss_fn}, strategy=strategy)
trainer.fit(data, epochs=1, global_batch_size=16)
raise AssertionError("spread plan must stop the script at fit")
"""


@pytest.mark.parametrize("loss_fn", ["None", "on_logits"])
def test_a_hugging_face_script_is_captured_and_profiled_as_the_trainer_runs_it(tmp_path, loss_fn):
    """``loss_fn=None`` (the loss the model computes from ``labels``) was refused, and a loss_fn on
    the logits got the whole ``ModelOutput`` (AttributeError: no attribute 'reshape')."""
    pytest.importorskip("transformers")
    script = tmp_path / "hf_train.py"
    script.write_text(_HF_SCRIPT.format(loss_fn=loss_fn))
    workload = capture_script(str(script))
    assert workload.global_batch == 16 and set(workload.inputs) == {"input_ids", "labels"}
    assert (workload.loss_fn is None) == (loss_fn == "None")
    profile = measure_model(
        workload.model, workload.loss_fn, workload.inputs, workload.targets, threads=(1,), repeats=1
    )
    assert profile.batch == 16 and profile.compute_seconds(16, 1) > 0
    assert profile.activation_bytes_per_sample > 0
