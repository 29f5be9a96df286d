"""PipelineStrategy on a Hugging Face GPT-2 split at a module path, fed as on one device: dict batches
(``model(**batch)``, ``labels`` reaching the stage that computes the loss) and ``loss_fn=None`` (the
model's own ``.loss``), under every schedule, zero bubble included: equal to one device. Bad input is
refused by every rank alike, by name."""

from __future__ import annotations

import pytest
import torch
from _equivalence_cases import max_relative_difference
from torch.nn import functional as F

import spread
from spread.pipeline import SCHEDULES

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, SAMPLES, BATCH = 96, 12, 10, 4  # the last global batch has 2 samples
SPLIT = ["transformer.h.1"]
TOLERANCE = 1e-5


def make_gpt2(n_layer: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=n_layer,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=16,
        # Dropout draws random numbers per stage process: equal in distribution, not bit for bit.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class TokenBatches(torch.utils.data.Dataset):
    """A tokenized dataset: one dict of tensors per sample. ``ignored``: that many trailing labels of
    every other sample are -100 (padding the loss skips), so samples count different numbers of tokens."""

    def __init__(self, ignored: int = 0) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.labels = self.ids.clone()
        if ignored:
            self.labels[::2, -ignored:] = -100

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(SEQ, dtype=torch.int64)
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.labels[i]}


def shifted_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A user's loss on a dict batch: the Trainer hands it the output's logits and the batch's labels."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def fit(strategy, loss_fn=None, *, ignored: int = 0, accumulation_steps: int = 1) -> dict:
    with strategy.scope():
        model = make_gpt2()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    trainer = spread.Trainer(
        model, optimizer, loss_fn, strategy=strategy, accumulation_steps=accumulation_steps
    )
    data = TokenBatches(ignored)
    history = trainer.fit(data, epochs=2, global_batch_size=BATCH, verbose=0)
    evaluated = trainer.evaluate(data, global_batch_size=BATCH)
    predicted = trainer.predict(data, global_batch_size=BATCH)
    pipelined = isinstance(strategy, spread.PipelineStrategy)
    state = strategy.gather_state_dict(model) if pipelined else model.state_dict()
    return {
        "loss": history.history["loss"],
        "evaluate": evaluated["loss"],
        "predict": predicted,
        "state": {k: v.detach().clone() for k, v in state.items()},
    }


def _pipeline_worker(schedule: str, user_loss: bool, replicas: int, ignored: int = 0) -> dict:
    strategy = spread.PipelineStrategy(
        stages=2, replicas=replicas, microbatches=3, schedule=schedule, split_points=SPLIT
    )
    try:
        return fit(strategy, shifted_lm_loss if user_loss else None, ignored=ignored)
    finally:
        strategy.close()


def assert_equal_runs(got: dict, ref: dict, who: str) -> None:
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (who, got["loss"], ref["loss"])
    assert got["evaluate"] == pytest.approx(ref["evaluate"], rel=1e-5), who
    torch.testing.assert_close(got["predict"], ref["predict"], rtol=1e-4, atol=1e-5, msg=who)
    diff = max_relative_difference(got["state"], ref["state"])
    assert diff <= TOLERANCE, f"{who}: max relative difference {diff:.2e}"


CASES = [(schedule, False, 1) for schedule in SCHEDULES] + [("zb", True, 1), ("zb", False, 2)]


@pytest.mark.parametrize(
    ("schedule", "user_loss", "replicas"),
    CASES,
    ids=[*(f"{s}_model_loss" for s in SCHEDULES), "zb_user_loss_fn", "zb_model_loss_hybrid_2x2"],
)
@pytest.mark.processes
def test_gpt2_on_dict_batches_equals_one_device(schedule, user_loss, replicas):
    """3 micro-batches of 2 samples (sizes 1, 1, 2 traced apart), the last global batch 2 samples: the
    labels are cut with the inputs and reach the last stage, whose loss is the model's own."""
    from spread.testing import run_ranks

    ref = fit(spread.OneDeviceStrategy("cpu"), shifted_lm_loss if user_loss else None)
    per_rank = run_ranks(_pipeline_worker, 2 * replicas, args=(schedule, user_loss, replicas), timeout=300)
    for rank, got in enumerate(per_rank):
        assert_equal_runs(got, ref, f"rank {rank}")


@pytest.mark.processes
def test_ignored_labels_weigh_micro_batches_by_samples_as_gradient_accumulation_does():
    """The documented limit of a model's own mean loss: with -100 labels spread unevenly, each
    micro-batch's token mean is weighted by its samples, which is one device accumulating
    ``microbatches`` micro-batches, and not the token mean of the whole batch."""
    from spread.testing import run_ranks

    one = spread.OneDeviceStrategy("cpu")
    whole = fit(one, ignored=5)
    accumulated = fit(spread.OneDeviceStrategy("cpu"), ignored=5, accumulation_steps=3)
    per_rank = run_ranks(_pipeline_worker, 2, args=("1f1b", False, 1, 5), timeout=300)
    for rank, got in enumerate(per_rank):
        assert max_relative_difference(got["state"], accumulated["state"]) <= TOLERANCE, rank
        assert got["loss"] == pytest.approx(accumulated["loss"], rel=1e-5), rank
    assert max_relative_difference(accumulated["state"], whole["state"]) > 100 * TOLERANCE  # it shows


def _refusals_worker() -> dict[str, str]:
    """Each refusal on every rank, before any rank waits for another (the job goes on afterwards)."""
    found: dict[str, str] = {}
    strategy = spread.PipelineStrategy(stages=2, microbatches=2, split_points=SPLIT)
    try:
        with strategy.scope():
            short = make_gpt2(n_layer=1)  # no transformer.h.1
        optimizer = torch.optim.SGD(short.parameters(), lr=0.1)
        try:
            spread.Trainer(short, optimizer, None, strategy=strategy)
        except ValueError as exc:
            found["split_point_not_found"] = str(exc)
        with strategy.scope():
            model = make_gpt2()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        no_labels = {"input_ids": TokenBatches().ids, "attention_mask": torch.ones(SAMPLES, SEQ)}
        for name, loss_fn in (("no_labels_model_loss", None), ("no_labels_loss_fn", shifted_lm_loss)):
            trainer = spread.Trainer(model, optimizer, loss_fn, strategy=strategy)
            try:
                trainer.fit(torch.utils.data.StackDataset(**no_labels), global_batch_size=BATCH, verbose=0)
            except ValueError as exc:
                found[name] = str(exc)
        # The job is still usable: one step with labels trains.
        trainer = spread.Trainer(model, optimizer, None, strategy=strategy)
        history = trainer.fit(TokenBatches(), global_batch_size=BATCH, steps_per_epoch=1, verbose=0)
        found["then_trains"] = str(history.history["loss"])
        return found
    finally:
        strategy.close()


@pytest.mark.processes
def test_bad_input_is_refused_by_name_on_every_rank():
    from spread.testing import run_ranks

    for rank, found in enumerate(run_ranks(_refusals_worker, 2, timeout=240)):
        assert "['transformer.h.1'] are not submodules of GPT2LMHeadModel" in found["split_point_not_found"]
        assert "loss_fn=None" in found["no_labels_model_loss"], rank
        assert "has no 'loss'" in found["no_labels_model_loss"], rank
        assert "without 'labels' and a loss_fn" in found["no_labels_loss_fn"], rank
        assert found["then_trains"].startswith("["), rank


def test_layer_split_pipelines_refuse_dict_batches_and_the_models_own_loss(monkeypatch):
    """One process (one stage): the checks every rank runs before any transfer."""
    for var in ("RANK", "WORLD_SIZE", "TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    strategy = spread.PipelineStrategy(stages=1, microbatches=2)
    try:
        with strategy.scope():
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        trainer = spread.Trainer(model, optimizer, torch.nn.MSELoss(), strategy=strategy)
        with pytest.raises(TypeError, match=r"dict batch .* only for a model split at module paths"):
            trainer.fit(torch.utils.data.StackDataset(input=x, labels=y), global_batch_size=4, verbose=0)
        trainer = spread.Trainer(model, optimizer, None, strategy=strategy)
        with pytest.raises(ValueError, match=r"loss_fn=None.*split by layer index needs a loss_fn"):
            trainer.fit((x, y), global_batch_size=4, verbose=0)
    finally:
        strategy.close()
