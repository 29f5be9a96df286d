"""ShardedStrategy(shard="parameters") takes a model built on the meta device and gives each rank its
shards of exactly the values one device draws (an MLP, a Hugging Face GPT-2 whose initialisation
transformers skips on meta), so training equals one device; a meta model given to prepare_model is
initialised module by module; what cannot hold is refused by name."""

from __future__ import annotations

import os

import pytest
import torch
from _equivalence_cases import max_relative_difference
from torch import nn

import spread
from spread.errors import SpreadError
from spread.testing import run_ranks

WORLD = 2
TOLERANCE = 1e-5
STEPS = 3
VOCAB, SEQ = 50, 8


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def _units(kind: str):
    if kind == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return (GPT2Block,)
    return "modules"


def _data(kind: str):
    g = torch.Generator().manual_seed(5)
    if kind == "gpt2":
        ids = torch.randint(0, VOCAB, (STEPS * 4, SEQ), generator=g)
        return (ids,)
    return torch.randn(STEPS * 4, 10, generator=g), torch.randint(0, 3, (STEPS * 4,), generator=g)


def _loss(kind: str, model: nn.Module, batch) -> torch.Tensor:
    if kind == "gpt2":
        (ids,) = batch
        return model(input_ids=ids, labels=ids).loss
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Not Adam: GPT-2's key biases get gradients of rounding noise only (softmax ignores them), which
    # Adam scales up to whole steps, so two exact runs would differ there.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(strategy, kind: str, model: nn.Module, optimizer) -> dict:
    dataset = strategy.distribute_dataset(_data(kind), 4, shuffle=False)
    for batch in dataset:
        optimizer.zero_grad()
        strategy.run(lambda *b: _loss(kind, model, b).backward(), args=tuple(batch))
        optimizer.step()
    return strategy.full_state_dict(model)


def _one_device(kind: str) -> dict:
    strategy = spread.OneDeviceStrategy("cpu")
    with strategy.scope():
        torch.manual_seed(0)
        model = _mlp() if kind == "mlp" else _gpt2()
        state_after_build = torch.get_rng_state()
        optimizer = _optimizer(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    return {"initial": initial, "rng": state_after_build, "trained": _train(strategy, kind, model, optimizer)}


def _meta_in_scope(strategy, kind: str, seed: int) -> dict:
    with strategy.scope(), torch.device("meta"):
        torch.manual_seed(seed)
        model = _mlp() if kind == "mlp" else _gpt2()
        optimizer = _optimizer(model)
    rng = torch.get_rng_state()
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    initial = strategy.full_state_dict(model)
    return {"initial": initial, "rng": rng, "trained": _train(strategy, kind, model, optimizer)}


def _meta_outside_scope(strategy, seed: int) -> dict:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = _mlp()
    strategy.prepare_model(model)  # FSDP2's way: built on meta, then handed over
    optimizer = _optimizer(model)
    initial = strategy.full_state_dict(model)
    return {"initial": initial, "trained": _train(strategy, "mlp", model, optimizer)}


def _job() -> dict:
    # Non-chief ranks use another seed: every rank must end with the chief's values.
    seed = 101 * int(os.environ["RANK"])
    owner = spread.ShardedStrategy("parameters", units=_units("mlp"))
    try:
        out = {"mlp": _meta_in_scope(owner, "mlp", seed)}
        with spread.ShardedStrategy("parameters", units=_units("gpt2")) as strategy:
            out["gpt2"] = _meta_in_scope(strategy, "gpt2", seed)
        with spread.ShardedStrategy("parameters") as strategy:
            out["prepared"] = _meta_outside_scope(strategy, seed)
        return out
    finally:
        owner.close()


@pytest.mark.processes
def test_meta_built_models_get_one_devices_values_and_train_as_one_device():
    pytest.importorskip("transformers")
    expected = {kind: _one_device(kind) for kind in ("mlp", "gpt2")}
    expected["prepared"] = expected["mlp"]
    for rank, results in enumerate(run_ranks(_job, WORLD, timeout=240)):
        for kind, got in results.items():
            want = expected[kind]
            who = f"rank {rank}, {kind}"
            assert got["initial"].keys() == want["initial"].keys(), who
            for name, value in want["initial"].items():
                assert torch.equal(got["initial"][name], value), f"{who}: initial {name}"
            if "rng" in got:  # the generator ends where one device's does after building
                assert torch.equal(got["rng"], want["rng"]), who
            diff = max_relative_difference(got["trained"], want["trained"])
            assert diff <= TOLERANCE, f"{who}: max relative weight difference after training {diff:.2e}"


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))


def _refusals() -> dict[str, str]:
    """Each bad case's error message (every rank runs every case alike)."""
    out: dict[str, str] = {}
    owner = spread.MultiWorkerMirroredStrategy()  # owns the process group; the others reuse it
    try:
        cases = {
            "mirrored": (None, lambda s: _build_in_scope(owner)),
            "sharded_optimizer": ("optimizer", _build_in_scope),
            "real_draw_after": ("parameters", lambda s: _build_in_scope(s, draw_after=True)),
            "no_reset_parameters": ("parameters", lambda s: _prepare_meta(s, _NoReset)),
            "own_generator": ("parameters", lambda s: _build_in_scope(s, generator=True)),
        }
        for name, (shard, case) in cases.items():
            strategy = spread.ShardedStrategy(shard) if shard else owner
            try:
                with pytest.raises(SpreadError) as caught:
                    case(strategy)
                out[name] = str(caught.value)
            finally:
                if strategy is not owner:
                    strategy.close()
        # init_fn: what prepare_model initialises each module with, instead of reset_parameters.
        with spread.ShardedStrategy("parameters") as strategy:
            with torch.device("meta"):
                model = nn.Sequential(_NoReset(), nn.Linear(4, 2))
            strategy.prepare_model(model, init_fn=_halves)
            weights = strategy.full_state_dict(model)
            out["init_fn"] = str(all(torch.equal(v, torch.full_like(v, 0.5)) for v in weights.values()))
        return out
    finally:
        owner.close()


def _halves(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        nn.init.constant_(p, 0.5)


def _build_in_scope(strategy, *, draw_after: bool = False, generator: bool = False) -> None:
    with strategy.scope(), torch.device("meta"):
        model = _mlp()
        if generator:
            nn.init.normal_(model[0].weight, generator=torch.Generator().manual_seed(1))
        if draw_after:
            torch.randn(3, device="cpu")


def _prepare_meta(strategy, build) -> None:
    with torch.device("meta"):
        model = build()
    strategy.prepare_model(model)


@pytest.mark.processes
def test_what_cannot_be_exact_is_refused_by_name():
    for rank, messages in enumerate(run_ranks(_refusals, WORLD, timeout=120)):
        who = f"rank {rank}"
        assert messages["mirrored"].startswith(
            "MultiWorkerMirroredStrategy cannot take a model on the meta device (Linear.weight, Linear.bias"
        ), who
        assert "ShardedStrategy(shard='parameters')" in messages["mirrored"], who
        assert (
            "at shard='optimizer' every process holds every parameter whole" in messages["sharded_optimizer"]
        )
        assert "random numbers were drawn on cpu (aten.randn.default)" in messages["real_draw_after"], who
        assert messages["no_reset_parameters"].startswith("_NoReset holds scale on the meta device"), who
        assert "generator of its own" in messages["own_generator"], who
        assert messages["init_fn"] == "True", who


def test_one_device_refuses_a_meta_model_by_name():
    strategy = spread.OneDeviceStrategy("cpu")
    with (
        pytest.raises(
            SpreadError, match=r"OneDeviceStrategy cannot take a model on the meta device \(Linear"
        ),
        strategy.scope(),
        torch.device("meta"),
    ):
        model = _mlp()
    assert model is not None
