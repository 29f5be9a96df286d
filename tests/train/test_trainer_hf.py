"""Hugging Face models without glue: dict batches into ``model(**batch)``, the model's own loss
(``loss_fn=None``), ``ModelOutput`` results in metrics and ``predict``; equal to one device."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

import spread
from spread.errors import SpreadError
from spread.testing import run_ps_job, run_ranks

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 64, 8


class TokenBatches(Dataset):
    """Tokenizer-style samples: a dict of tensors per sample, as a tokenized HF dataset yields."""

    def __init__(self, n: int, *, classes: int | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
        self.mask = torch.ones(n, LENGTH, dtype=torch.int64)
        self.labels = self.ids.clone() if classes is None else (self.ids[:, 0] % classes)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _train(strategy: spread.Strategy, data: Dataset, make_model, **fit) -> tuple[dict, torch.nn.Module]:
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = spread.Trainer(model, optimizer, None, strategy=strategy)
    history = trainer.fit(data, epochs=2, global_batch_size=4, shuffle=False, verbose=0, **fit)
    return history.history, model


@pytest.mark.parametrize("strategy_class", [spread.MirroredStrategy, spread.CentralStorageStrategy])
def test_gpt2_on_dict_batches_equals_one_device(strategy_class):
    """CentralStorage too: its variables live on one device and the replicas read them there, which
    GPT-2's tied input and output embedding must survive (one parameter, two uses)."""
    data = TokenBatches(10)  # 10 samples, global batch 4: the last batch has 2 (one per replica)
    one_logs, one = _train(spread.OneDeviceStrategy(), data, _gpt2)
    two_logs, two = _train(strategy_class(num_replicas=2), data, _gpt2)
    assert one_logs["loss"] == pytest.approx(two_logs["loss"], rel=1e-5)
    for (name, a), b in zip(one.state_dict().items(), two.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def _save_pretrained(strategy: spread.Strategy, model: torch.nn.Module, directory: str) -> str:
    """What a script does after ``fit``: the chief calls ``save_pretrained``. It must write the trained
    weights or raise naming the call to use; then that call (``full_state_dict``, on every rank)."""
    outcome = "saved"
    if strategy.is_chief:
        try:
            model.save_pretrained(f"{directory}/plain")
        except SpreadError as exc:
            outcome = str(exc)
    weights = strategy.full_state_dict(model)  # collective where the model is split
    if strategy.is_chief:
        model.save_pretrained(f"{directory}/full", state_dict=weights)
    return outcome


def _weights_after_fit(strategy: spread.Strategy, directory: str) -> dict:
    try:
        _, model = _train(strategy, TokenBatches(10), _gpt2)
        weights = {k: v.detach().clone() for k, v in strategy.full_state_dict(model).items()}
        return {"weights": weights, "saved": _save_pretrained(strategy, model, directory)}
    finally:
        strategy.close()


def _process_worker(strategy_name: str, directory: str) -> dict:
    if strategy_name.startswith("sharded-"):
        return _weights_after_fit(
            spread.ShardedStrategy(shard=strategy_name.removeprefix("sharded-")), directory
        )
    return _weights_after_fit(spread.MultiWorkerMirroredStrategy(), directory)


def _ps_worker(directory: str) -> dict:
    return _weights_after_fit(spread.ParameterServerStrategy(mode="sync"), directory)


def _assert_same_weights(expected: torch.nn.Module, got: dict[str, torch.Tensor], who: str) -> None:
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(
            got[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{who}: {name}: {m}"
        )


def _assert_pretrained(expected: torch.nn.Module, directory, saved: str, who: str) -> None:
    """``save_pretrained`` wrote the trained weights (loadable with ``from_pretrained``), or refused
    naming ``full_state_dict``; the weights saved through ``full_state_dict`` load everywhere."""
    folders = ["full"]
    if saved == "saved":
        folders.append("plain")
    else:
        assert "strategy.full_state_dict(model)" in saved, f"{who}: {saved}"
    for folder in folders:
        loaded = transformers.GPT2LMHeadModel.from_pretrained(directory / folder)
        _assert_same_weights(expected, loaded.state_dict(), f"{who}, save_pretrained ({folder})")


@pytest.mark.parametrize(
    "make",
    [spread.OneDeviceStrategy, lambda: spread.MirroredStrategy(num_replicas=2)],
    ids=["one", "mirrored"],
)
def test_save_pretrained_after_fit_writes_the_trained_weights(tmp_path, make):
    _, one = _train(spread.OneDeviceStrategy(), TokenBatches(10), _gpt2)
    result = _weights_after_fit(make(), str(tmp_path))
    _assert_pretrained(one, tmp_path, result["saved"], "in process")


@pytest.mark.processes
@pytest.mark.parametrize(
    "strategy_name", ["multi_worker_mirrored", "sharded-optimizer", "sharded-gradients", "sharded-parameters"]
)
def test_gpt2_on_dict_batches_in_processes_equals_one_device(tmp_path, strategy_name):
    """Two processes, GPT-2's own loss on dict batches, its tied embedding sharded; the chief's
    ``save_pretrained`` after ``fit`` writes the trained weights or refuses (never zeros)."""
    _, one = _train(spread.OneDeviceStrategy(), TokenBatches(10), _gpt2)
    per_rank = run_ranks(_process_worker, 2, args=(strategy_name, str(tmp_path)), timeout=180)
    for rank, result in enumerate(per_rank):
        _assert_same_weights(one, result["weights"], f"{strategy_name} rank {rank}")
    _assert_pretrained(one, tmp_path, per_rank[0]["saved"], strategy_name)
    if strategy_name == "sharded-parameters":  # each rank holds 1/N between steps: refused
        assert per_rank[0]["saved"] != "saved"


@pytest.mark.processes
def test_gpt2_on_dict_batches_under_sync_parameter_servers_equals_one_device(tmp_path):
    _, one = _train(spread.OneDeviceStrategy(), TokenBatches(10), _gpt2)
    results = run_ps_job(_ps_worker, 2, 1, args=(str(tmp_path),), timeout=240)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results if not r.ok)
    for worker in (0, 1):
        _assert_same_weights(one, results[worker].value["weights"], f"parameter-server worker {worker}")
    _assert_pretrained(one, tmp_path, results[0].value["saved"], "parameter servers")


def _async_ps_worker() -> list[float]:
    strategy = spread.ParameterServerStrategy()  # async: no equality to claim, each task steps alone
    try:
        with strategy.scope():
            model = _gpt2()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trainer = spread.Trainer(model, optimizer, None, strategy=strategy)
        return trainer.fit(TokenBatches(32), epochs=3, global_batch_size=8, verbose=0).history["loss"]
    finally:
        strategy.close()


@pytest.mark.processes
def test_gpt2_on_dict_batches_trains_under_async_parameter_servers():
    results = run_ps_job(_async_ps_worker, 2, 1, timeout=240)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results if not r.ok)
    for worker in (0, 1):
        losses = results[worker].value
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_a_dict_of_tensors_trains_like_a_dataset_of_dict_samples():
    """``fit({"input_ids": ids, ...})``, Keras' named inputs: the same batches as the sample dicts."""
    data = TokenBatches(10)
    columns = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}
    samples_logs, samples = _train(spread.MirroredStrategy(num_replicas=2), data, _gpt2)
    columns_logs, by_columns = _train(spread.MirroredStrategy(num_replicas=2), columns, _gpt2)
    assert columns_logs["loss"] == samples_logs["loss"]
    for (name, a), b in zip(samples.state_dict().items(), by_columns.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_a_replica_without_samples_takes_part_with_zero_gradients():
    data = TokenBatches(9)  # the last global batch has 1 sample: replica 1 gets none
    one_logs, one = _train(spread.OneDeviceStrategy(), data, _gpt2)
    two_logs, two = _train(spread.MirroredStrategy(num_replicas=2), data, _gpt2)
    assert one_logs["loss"] == pytest.approx(two_logs["loss"], rel=1e-5)
    for a, b in zip(one.parameters(), two.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_bert_classifier_with_accuracy_and_predict():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    strategy = spread.MirroredStrategy(num_replicas=2)
    with strategy.scope():
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TokenBatches(12, classes=3)
    trainer = spread.Trainer(model, optimizer, None, strategy=strategy, metrics=["accuracy"])
    history = trainer.fit(data, epochs=1, global_batch_size=4, verbose=0)
    assert 0.0 <= history.history["accuracy"][0] <= 1.0
    logs = trainer.evaluate(data, global_batch_size=8)
    assert set(logs) == {"loss", "accuracy"}
    logits = trainer.predict(data, global_batch_size=8)
    assert logits.shape == (12, 3)


def test_loss_fn_none_with_a_model_that_computes_no_loss_is_a_clear_error():
    model = torch.nn.Linear(4, 2)
    trainer = spread.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError, match=r"loss_fn=None.*has no 'loss'"):
        trainer.fit(data, epochs=1, global_batch_size=4, verbose=0)
