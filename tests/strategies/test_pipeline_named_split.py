"""PipelineStrategy with split points named by module path: a Hugging Face GPT-2 (tied embedding and
LM head) split in two stages trains equal to one device; tied parameters stay one parameter; a
rank's ``model.state_dict()`` refuses to hand out stale layers."""

from __future__ import annotations

import pytest
import torch
from _equivalence_cases import max_relative_difference
from torch import nn
from torch.nn import functional as F

import spread

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, SAMPLES, BATCH = 256, 16, 40, 8
TOLERANCE = 1e-5


def make_gpt2(tie: bool = True) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        tie_word_embeddings=tie,
        # Dropout draws random numbers per stage process: equal in distribution, not bit for bit.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def lm_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (input_ids, labels)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The Trainer gives loss_fn the model output's ``logits`` (under a pipeline too)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def fit_gpt2(strategy, tie: bool = True) -> dict:
    with strategy.scope():
        model = make_gpt2(tie)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    trainer = spread.Trainer(model, optimizer, lm_loss, strategy=strategy)
    history = trainer.fit(lm_data(), epochs=2, global_batch_size=BATCH, verbose=0)
    evaluated = trainer.evaluate(lm_data(), global_batch_size=BATCH)
    out: dict = {"loss": history.history["loss"], "evaluate": evaluated}
    if isinstance(strategy, spread.PipelineStrategy):
        try:
            model.state_dict()
            out["stale_state_dict"] = "no error"
        except spread.errors.SpreadError as exc:
            out["stale_state_dict"] = str(exc)
        out["state"] = strategy.gather_state_dict(model)
        after = model.state_dict()  # current again after the gather, until the next step
        out["state_dict_after_gather"] = max_relative_difference(after, out["state"])
        out["tied_is_one_parameter"] = model.lm_head.weight is model.transformer.wte.weight
    else:
        out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _gpt2_worker(schedule: str, tie: bool, replicas: int) -> dict:
    schedule, _, extra = schedule.partition("+")
    strategy = spread.PipelineStrategy(
        stages=2,
        replicas=replicas,
        microbatches=3 if extra else 2,  # 3: micro-batches of 3, 3 and 2 samples, two traced shapes
        schedule=schedule,
        split_points=["transformer.h.2"],
        checkpoint_stages=extra == "checkpoint",
    )
    try:
        return fit_gpt2(strategy, tie)
    finally:
        strategy.close()


@pytest.mark.parametrize(
    ("schedule", "tie", "replicas"),
    [("1f1b", True, 1), ("gpipe", False, 1), ("gpipe+checkpoint", True, 1), ("1f1b", True, 2)],
    ids=["tied_1f1b", "untied_gpipe", "tied_gpipe_checkpointed_uneven", "tied_hybrid_2x2"],
)
@pytest.mark.processes
def test_gpt2_split_by_module_name_equals_one_device(schedule, tie, replicas):
    from spread.testing import run_ranks

    ref = fit_gpt2(spread.OneDeviceStrategy("cpu"), tie)
    per_rank = run_ranks(_gpt2_worker, 2 * replicas, args=(schedule, tie, replicas), timeout=300)
    for rank, got in enumerate(per_rank):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (rank, got["loss"], ref["loss"])
        assert got["evaluate"]["loss"] == pytest.approx(ref["evaluate"]["loss"], rel=1e-5)
        diff = max_relative_difference(got["state"], ref["state"])
        assert diff <= TOLERANCE, f"rank {rank}: max relative difference {diff:.2e}"
        if tie:  # one parameter, under both of its names, equal to one device's
            assert got["tied_is_one_parameter"]
            torch.testing.assert_close(got["state"]["lm_head.weight"], ref["state"]["transformer.wte.weight"])
        # Saving model.state_dict() on a pipeline rank cannot give a half-trained model silently.
        assert "out of date" in got["stale_state_dict"] and "gather_state_dict" in got["stale_state_dict"]
        assert got["state_dict_after_gather"] == 0.0


# -- tied parameters in an nn.Sequential split by layer index ---------------------------------------
class _Tied(nn.Module):
    """Applies a given linear layer's weight, transposed (a decoder tied to an encoder)."""

    def __init__(self, encoder: nn.Linear) -> None:
        super().__init__()
        self.weight = encoder.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def make_tied_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    encoder = nn.Linear(6, 12)
    return nn.Sequential(encoder, nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), _Tied(encoder))


def fit_tied_sequential(strategy) -> dict:
    with strategy.scope():
        model = make_tied_sequential()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(48, 6, generator=g), torch.randn(48, 6, generator=g)
    trainer = spread.Trainer(model, optimizer, nn.MSELoss(), strategy=strategy, clip_grad_norm=0.5)
    history = trainer.fit((x, y), epochs=2, global_batch_size=16, verbose=0)
    gather = strategy.gather_state_dict if isinstance(strategy, spread.PipelineStrategy) else None
    state = gather(model) if gather else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"loss": history.history["loss"], "state": state}


def _tied_sequential_worker() -> dict:
    strategy = spread.PipelineStrategy(stages=2, microbatches=2, split_points=[2])
    try:
        return fit_tied_sequential(strategy)
    finally:
        strategy.close()


@pytest.mark.processes
def test_a_parameter_two_stages_use_gets_their_summed_gradient():
    """Clipping by the global norm too: the tied gradient counts once in it, as on one device."""
    from spread.testing import run_ranks

    ref = fit_tied_sequential(spread.OneDeviceStrategy("cpu"))
    for rank, got in enumerate(run_ranks(_tied_sequential_worker, 2, timeout=240)):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), rank
        assert max_relative_difference(got["state"], ref["state"]) <= TOLERANCE, rank


# -- bad arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 3, "split_points": ["transformer.h.2"]}, "must name stages-1=2 module paths"),
        ({"stages": 2, "split_points": [""]}, "must name stages-1=1 module paths"),
        ({"stages": 3, "split_points": ["a", "a"]}, "distinct module paths"),
    ],
)
def test_bad_named_split_points_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        spread.PipelineStrategy(**kwargs)
