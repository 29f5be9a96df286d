"""Recording a model's construction on the meta device and replaying it on a real one gives the values
the same code gives built on that device, bit for bit, and leaves the generator where it would be;
replay holds about one tensor at a time; what cannot be exact is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from _tiny_gpt import TinyGPT
from torch import nn

from spread.errors import SpreadError
from spread.memory.hf_meta_init import record_skipped_init
from spread.memory.meta_init import MetaInitRecorder

CPU = torch.device("cpu")


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))


class _Custom(nn.Module):
    """Values from torch ops in __init__ (no reset_parameters), a reseed half-way, a deep copy, a
    cast, a buffer computed from a parameter, a partial write into a view, and the torch.nn.init
    functions that skip meta tensors (trunc_normal_'s rejection sampling depends on the values)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4, 6) * 0.02)
        self.first = nn.Linear(6, 6)
        torch.manual_seed(3)
        self.second = copy.deepcopy(self.first)
        self.second.weight.data[:, :2].zero_()
        self.double_layer = nn.Linear(6, 2).to(torch.float64)
        self.register_buffer("norms", self.scale.detach().norm(dim=1))
        nn.init.trunc_normal_(self.first.weight, std=0.1)  # these two return at once on meta
        nn.init.orthogonal_(self.double_layer.weight)


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _replayed(build, seed: int = 0):
    """Build under the recorder on the meta device and replay: (values by name, recording, model)."""
    torch.manual_seed(seed)
    recorder = MetaInitRecorder(CPU)
    with recorder, torch.device("meta"):
        model = build()
    record_skipped_init(recorder, list(model.modules()))
    named = [*model.named_parameters(), *model.named_buffers()]
    values: dict[str, torch.Tensor] = {}
    recorder.recording.replay([t for _, t in named], lambda i, v: values.__setitem__(named[i][0], v.clone()))
    return values, recorder.recording, model


@pytest.mark.parametrize("build", [_mlp, TinyGPT, _Custom, _gpt2], ids=["mlp", "tiny_gpt", "custom", "gpt2"])
def test_replay_gives_one_devices_values_and_generator_state(build):
    torch.manual_seed(0)
    reference = build()
    state_after = torch.get_rng_state()
    expected = dict([*reference.named_parameters(), *reference.named_buffers()])
    values, _, _ = _replayed(build)
    assert values.keys() == expected.keys()
    for name, value in expected.items():
        assert value.dtype == values[name].dtype, name
        assert torch.equal(values[name], value), name
    assert torch.equal(torch.get_rng_state(), state_after)


def test_replay_skips_overwritten_values_and_holds_about_one_tensor():
    """Sixteen 256x256 layers re-initialised by a model-wide pass (as Hugging Face's): the layers' own
    draws are overwritten, so replay never holds more than one weight and its bias."""

    def build() -> nn.Module:
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])
        for layer in model:
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)
        return model

    torch.manual_seed(0)
    expected = build().state_dict()
    values, recording, _ = _replayed(build)
    assert all(torch.equal(values[k], v) for k, v in expected.items())
    one_layer = (256 * 256 + 256) * 4
    assert recording.peak_bytes <= one_layer, recording.peak_bytes


def test_a_seed_set_after_the_last_draw_is_kept():
    torch.manual_seed(0)
    recorder = MetaInitRecorder(CPU)
    with recorder, torch.device("meta"):
        model = _mlp()
        torch.manual_seed(42)
    expected = torch.get_rng_state()
    params = list(model.parameters())
    recorder.recording.replay(params, lambda i, v: None)
    assert torch.equal(torch.get_rng_state(), expected)


def test_a_generator_of_its_own_is_refused():
    generator = torch.Generator().manual_seed(1)
    with (
        pytest.raises(SpreadError, match="generator of its own"),
        MetaInitRecorder(CPU),
        torch.device("meta"),
    ):
        torch.nn.init.normal_(torch.empty(3, 3), generator=generator)


def test_real_draws_after_meta_draws_are_noted_unless_seeded_between():
    recorder = MetaInitRecorder(CPU)
    with recorder:
        torch.randn(2)  # before any meta draw: fine
        with torch.device("meta"):
            _mlp()
        torch.randn(2)  # one device draws it after the MLP's values
        torch.manual_seed(1)
        torch.rand(2)  # after a seed: the same on one device
    assert recorder.recording.real_draws == ["aten.randn.default"]


def test_a_meta_tensor_made_before_recording_is_refused():
    outside = torch.empty(4, device="meta")
    recorder = MetaInitRecorder(CPU)
    with recorder:
        inside = outside * 2
    with pytest.raises(SpreadError, match="made before recording started"):
        recorder.recording.replay([inside], lambda i, v: None)
