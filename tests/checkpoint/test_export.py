"""Export (``spread.export``): the one-device weights from any strategy as safetensors, and Hugging
Face models in ``save_pretrained``'s layout, loadable with ``from_pretrained``; bad input refused."""

from __future__ import annotations

import errno
import resource
import signal
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import spread
from spread.export import save_pretrained, save_safetensors
from spread.testing import run_ranks

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, LENGTH = 100, 8
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


class TokenBatches(Dataset):
    """A tokenized data set's samples: dicts with the model's own labels."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _train_gpt2(strategy: spread.Strategy) -> nn.Module:
    with strategy.scope():
        model = _gpt2()
        # SGD: linear in the gradient, so the replicas' summation order stays within 1e-5 (Adam's
        # normalisation turns near-zero gradients' rounding into steps of size lr).
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = spread.Trainer(model, optimizer, None, strategy=strategy)
    trainer.fit(TokenBatches(10), epochs=1, global_batch_size=4, shuffle=False, verbose=0)
    return model


def _assert_same_weights(expected: nn.Module, got: dict[str, torch.Tensor], who: str) -> None:
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(got[name], value, **TOLERANCE, msg=lambda m, n=name: f"{who}: {n}: {m}")


def _assert_pretrained_layout(directory: Path) -> None:
    """``save_pretrained``'s files: the config, one weight file holding the tied embedding once."""
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    names = safetensors_torch.load_file(directory / "model.safetensors").keys()
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names


# -- from processes: data-parallel, sharded, pipelined ---------------------------------------------
def _export_worker(strategy_name: str, directory: str) -> None:
    if strategy_name == "multi_worker_mirrored":
        strategy: spread.Strategy = spread.MultiWorkerMirroredStrategy()
    else:  # each rank holds 1/N of the weights between steps; model.state_dict() refuses
        strategy = spread.ShardedStrategy(shard="parameters")
    try:
        model = _train_gpt2(strategy)
        save_pretrained(strategy, model, f"{directory}/pretrained")
        save_safetensors(strategy, model, f"{directory}/weights.safetensors")
    finally:
        strategy.close()


@pytest.mark.processes
@pytest.mark.parametrize("strategy_name", ["multi_worker_mirrored", "sharded-parameters"])
def test_gpt2_trained_in_processes_loads_with_from_pretrained(tmp_path, strategy_name):
    one = _train_gpt2(spread.OneDeviceStrategy())
    run_ranks(_export_worker, 2, args=(strategy_name, str(tmp_path)), timeout=180)
    _assert_pretrained_layout(tmp_path / "pretrained")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")
    _assert_same_weights(one, loaded.state_dict(), f"{strategy_name}, from_pretrained")
    ids = TokenBatches(3).ids
    one.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, one(input_ids=ids).logits, **TOLERANCE)
    weights = safetensors_torch.load_file(tmp_path / "weights.safetensors")
    assert weights.keys() == one.state_dict().keys()  # both tied names: loads into the model as it is
    _assert_same_weights(one, weights, f"{strategy_name}, save_safetensors")


def _sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _train_sequential(strategy: spread.Strategy) -> nn.Module:
    with strategy.scope():
        model = _sequential()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 10, generator=g), torch.randint(0, 3, (40,), generator=g)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
    trainer.fit((x, y), epochs=2, global_batch_size=8, shuffle=False, verbose=0)
    return model


def _pipeline_worker(path: str) -> None:
    strategy = spread.PipelineStrategy(stages=2, microbatches=2, schedule="1f1b", split_points=[2])
    try:
        save_safetensors(strategy, _train_sequential(strategy), path)
    finally:
        strategy.close()


@pytest.mark.processes
def test_a_two_stage_pipeline_exports_every_stage(tmp_path):
    """Each stage trains its own layers; the file holds both stages' trained weights."""
    one = _train_sequential(spread.OneDeviceStrategy())
    run_ranks(_pipeline_worker, 2, args=(str(tmp_path / "pipeline.safetensors"),), timeout=180)
    weights = safetensors_torch.load_file(tmp_path / "pipeline.safetensors")
    assert weights.keys() == one.state_dict().keys()
    _assert_same_weights(one, weights, "pipeline")


# -- in this process -------------------------------------------------------------------------------
def test_a_one_device_export_round_trips_and_replaces_an_earlier_sharded_one(tmp_path):
    strategy = spread.MirroredStrategy(num_replicas=2)
    model = _train_gpt2(strategy)
    save_pretrained(strategy, model, tmp_path, max_shard_size="100KB")  # several weight files
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_pretrained(strategy, model, tmp_path)  # one file: the shards and their index must go
    _assert_pretrained_layout(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    _assert_same_weights(model, loaded.state_dict(), "mirrored")


def test_save_pretrained_refuses_a_model_that_is_not_hugging_faces(tmp_path):
    with pytest.raises(TypeError, match=r"PreTrainedModel, got Linear.*spread\.export\.save_safetensors"):
        save_pretrained(spread.OneDeviceStrategy(), nn.Linear(2, 2), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_save_pretrained_refuses_the_arguments_it_decides(tmp_path):
    with pytest.raises(TypeError, match=r"does not take state_dict=.*full_state_dict"):
        save_pretrained(spread.OneDeviceStrategy(), _gpt2(), tmp_path, state_dict={})


def test_a_path_that_cannot_be_a_directory_is_named_and_left_alone(tmp_path):
    """``model.save_pretrained`` onto a file only logs an error and returns: refused here."""
    blocker = tmp_path / "blocker"
    blocker.write_text("keep")
    strategy, model = spread.OneDeviceStrategy(), _gpt2()
    with pytest.raises(NotADirectoryError, match=r"blocker'? is a file"):
        save_pretrained(strategy, model, blocker)
    with pytest.raises(NotADirectoryError) as under:
        save_pretrained(strategy, model, blocker / "out")
    assert under.value.filename == str(blocker / "out")
    with pytest.raises(OSError) as weights:
        save_safetensors(strategy, model, blocker / "weights.safetensors")
    assert str(blocker) in str(weights.value)
    assert blocker.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]


def test_a_full_disk_names_the_path_and_keeps_the_earlier_export(tmp_path):
    """A file-size limit fails a write (EFBIG) as a full disk does: config.json fits, the weights
    do not. The earlier files are still what loads, and nothing is left over."""
    strategy, before = spread.OneDeviceStrategy(), _gpt2()
    directory, weights = tmp_path / "pretrained", tmp_path / "weights.safetensors"
    save_pretrained(strategy, before, directory)
    save_safetensors(strategy, before, weights)
    after = _gpt2()
    with torch.no_grad():
        for p in after.parameters():
            p.add_(1.0)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        with pytest.raises(OSError) as pretrained_error:
            save_pretrained(strategy, after, directory)
        with pytest.raises(OSError) as weights_error:
            save_safetensors(strategy, after, weights)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    for error, path in [(pretrained_error.value, directory), (weights_error.value, weights)]:
        assert (error.errno, error.filename) == (errno.EFBIG, str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrained", "weights.safetensors"]
    _assert_pretrained_layout(directory)  # no temporary directory left either
    loaded = transformers.GPT2LMHeadModel.from_pretrained(directory)
    _assert_same_weights(before, loaded.state_dict(), "the earlier export")
    _assert_same_weights(before, safetensors_torch.load_file(weights), "the earlier weights file")
