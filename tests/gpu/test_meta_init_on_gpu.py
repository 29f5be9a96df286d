"""Meta-device construction replayed on a GPU: the values (and CUDA's generator state) equal building
the same code on the GPU, whose draws come from CUDA's generator (Philox), not the CPU's.

Skipped without CUDA; run on a GPU machine with ``python -m pytest tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spread.memory.hf_meta_init import record_skipped_init
from spread.memory.meta_init import MetaInitRecorder

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (and SPREAD_TEST_GPU=1, see tests/conftest.py)"
)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10))


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=97, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("build", [_mlp, _gpt2], ids=["mlp", "gpt2"])
def test_replay_on_the_gpu_equals_building_on_the_gpu(build):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.manual_seed(0)
    with device:
        reference = build()
    expected = {k: v.detach().clone() for k, v in [*reference.named_parameters(), *reference.named_buffers()]}
    state_after = torch.cuda.get_rng_state()

    torch.cuda.manual_seed(0)
    recorder = MetaInitRecorder(device)
    with recorder, torch.device("meta"):
        model = build()
    record_skipped_init(recorder, list(model.modules()))
    named = [*model.named_parameters(), *model.named_buffers()]
    got: dict[str, torch.Tensor] = {}
    recorder.recording.replay([t for _, t in named], lambda i, v: got.__setitem__(named[i][0], v.clone()))
    for name, value in expected.items():
        assert got[name].device == value.device, name
        assert torch.equal(got[name], value), name
    assert torch.equal(torch.cuda.get_rng_state(), state_after)
