"""Splitting any module at named submodules: the stages, run one after the other in one process,
compute exactly the whole model's outputs and gradients, with the user's own parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spread.pipeline.graph_split import GraphStage, check_split_points, flat_input, split_model
from spread.pipeline.split_backward import SplitBackward


class Skip(nn.Module):
    """A value made on stage 0 is used on stage 2 (relayed through stage 1); two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("offset", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        g = torch.relu(self.b(h))
        return self.c(g) + h + self.offset, g.sum(dim=1)


def run_stages(split, x):
    values: tuple = ()
    for stage in split.stages:
        values = stage(flat_input(x), *values)
    return values


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_three_stages_relay_a_skip_connection_and_equal_the_model():
    torch.manual_seed(0)
    model = Skip()
    x = torch.randn(3, 4)
    split = split_model(model, ["b", "c"], x)
    assert split.stages[0].receives == []
    assert len(split.stages[2].receives) == 2  # b's output and a's, relayed by stage 1
    expected = model(x)
    (expected[0].sum() + expected[1].sum()).backward()
    want = grads(model)
    model.zero_grad()
    got = run_stages(split, x)
    assert isinstance(got, tuple) and len(got) == 2
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    (got[0].sum() + got[1].sum()).backward()
    for name, g in grads(model).items():
        torch.testing.assert_close(g, want[name], rtol=0, atol=0)


def test_stages_use_the_users_own_parameters_and_buffers():
    model = Skip()
    split = split_model(model, ["b", "c"], torch.randn(2, 4))
    ids = [{id(t) for t in split.stage_tensors(s)} for s in range(3)]
    assert ids[0] == {id(model.a.weight), id(model.a.bias)}
    assert ids[2] == {id(model.c.weight), id(model.c.bias), id(model.offset)}


def make_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    sizes = {"n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}
    config = transformers.GPT2Config(**sizes, **no_dropout)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_tied_embedding_is_one_parameter_in_both_stages_and_outputs_match():
    model = make_gpt2()
    ids = torch.randint(0, 64, (2, 8))
    split = split_model(model, ["transformer.h.2"], ids)
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte
    assert all(any(t is wte for t in split.stage_tensors(s)) for s in (0, 1))  # one object, two stages
    expected = model(ids)
    expected.logits.sum().backward()
    want = grads(model)
    model.zero_grad()
    got = run_stages(split, ids)
    assert type(got) is type(expected) and got.past_key_values is None  # the cache is not a tensor: dropped
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=0)
    got.logits.sum().backward()
    for name, g in grads(model).items():  # the tied weight: embedding and LM head contributions summed
        torch.testing.assert_close(g, want[name], rtol=0, atol=0)
    assert "forward" not in model.transformer.h[2].__dict__  # the split marker is gone from the model


def test_graph_stage_traces_once_per_shape_and_mode():
    model = Skip()
    stage = GraphStage(model, ["b"], 1)
    x = torch.randn(2, 4)
    assert stage.prepare(x) is not None
    assert stage.prepare(torch.randn(2, 4)) is None  # same key
    assert stage.prepare(torch.randn(5, 4)) is not None  # another shape
    model.eval()
    assert stage.prepare(x) is not None  # eval mode: its own trace
    assert stage.num_received(x) == 1  # a(x): b's input and the residual
    used = (*model.b.parameters(), *model.c.parameters())
    assert {id(p) for p in stage.parameters()} == {id(p) for p in used}


@pytest.mark.parametrize(
    ("points", "match"),
    [(["nope"], r"\['nope'\] are not submodules of Skip"), (["b", "b"], "distinct module paths")],
)
def test_bad_split_points_are_refused_by_name(points, match):
    with pytest.raises(ValueError, match=match):
        check_split_points(Skip(), points)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.b(x)))


def test_a_split_point_called_twice_is_refused():
    with pytest.raises(ValueError, match="exactly once"):
        split_model(Twice(), ["b"], torch.randn(2, 4))


def lm_batch(rows: int = 2, seq: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def test_a_dict_batch_goes_to_the_stages_that_use_it_and_the_last_computes_the_models_loss():
    """Hugging Face style: model(**batch) with labels; the loss is made on the last stage."""
    model = make_gpt2()
    batch = lm_batch()
    split = split_model(model, ["transformer.h.2"], batch)
    index = {name: i for i, name in enumerate(batch)}
    uses = [{a for a in stage.args if isinstance(a, int)} for stage in split.stages]
    assert index["input_ids"] in uses[0] and index["input_ids"] not in uses[1]
    assert index["labels"] in uses[1] and index["labels"] not in uses[0]
    expected = model(**batch)
    expected.loss.backward()
    want = grads(model)
    model.zero_grad()
    got = run_stages(split, batch)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=0)
    got.loss.backward()
    for name, g in grads(model).items():
        torch.testing.assert_close(g, want[name], rtol=0, atol=0)


def test_graph_stage_keys_a_dict_batch_by_its_names_shapes_and_dtypes():
    model = make_gpt2()
    stage = GraphStage(model, ["transformer.h.2"], 1)
    batch = lm_batch()
    assert stage.prepare(batch) is not None
    assert stage.prepare(lm_batch()) is None  # same names, shapes and dtypes
    without_labels = {k: v for k, v in batch.items() if k != "labels"}
    assert stage.prepare(without_labels) is not None  # other names: its own trace (no loss)
    assert stage.rebuild(batch).num_tensors == 2 and stage.rebuild(without_labels).num_tensors == 1


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (
            {"input_ids": torch.zeros(2, 4, dtype=torch.long), "use_cache": False},
            r"\['use_cache'\] are not tensors",
        ),
        ([torch.zeros(2, 4, dtype=torch.long)], "one tensor .* or a dict of keyword tensors"),
        ({}, "one tensor .* or a dict of keyword tensors"),
    ],
)
def test_a_batch_of_another_kind_is_refused_by_name(batch, match):
    stage = GraphStage(Skip(), ["b"], 1)
    with pytest.raises(TypeError, match=match):
        stage.prepare(batch)


def test_a_traced_stage_splits_its_backward_exactly_and_leaves_no_parameter_unsplit():
    """Zero bubble on a stage cut out of an exported graph: several inputs (hidden states and the
    attention mask), the model's own loss; the input pass skips every weight product."""
    from torch.utils.flop_counter import FlopCounterMode

    model = make_gpt2()
    batch = lm_batch()
    split = split_model(model, ["transformer.h.2"], batch)
    first, last = split.stages
    sent = first(flat_input(batch))
    received = [t.detach().requires_grad_(t.is_floating_point()) for t in sent]
    reference = last(flat_input(batch), *received).loss
    with FlopCounterMode(display=False) as ordinary:
        reference.backward()
    want = {n: p.grad.clone() for n, p in last.named_parameters()}
    want_inputs = [t.grad.clone() for t in received if t.requires_grad]
    last.zero_grad(set_to_none=True)
    for t in received:
        t.grad = None

    splitter = SplitBackward(last)
    loss = last(flat_input(batch), *received).loss
    with FlopCounterMode(display=False) as input_pass:
        graph = splitter.backward_input(loss, None, received)
    assert graph.rest == [] and graph.split_params == len(want)
    assert all(p.grad is None for p in last.parameters())  # the input pass leaves the weights alone
    with FlopCounterMode(display=False) as weight_pass:
        splitter.backward_weight(graph)
    for got, expected in zip([t.grad for t in received if t.requires_grad], want_inputs, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for name, p in last.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-6, atol=1e-7, msg=name)
    # Nothing computed twice, and the weight products (about half the backward) moved to the later pass.
    flops = [m.get_total_flops() for m in (ordinary, input_pass, weight_pass)]
    assert flops[1] + flops[2] == flops[0] and flops[2] >= 0.4 * flops[0]
    splitter.close()
