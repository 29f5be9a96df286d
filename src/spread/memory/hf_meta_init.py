"""Hugging Face models built on the meta device: the weight initialisation transformers skips there.

transformers (5.x) does not run a model's ``_init_weights`` when it is built under
``torch.device("meta")``: its ``init_weights`` checks for it, because ``from_pretrained`` loads the
values afterwards. Built from a config on one device, each model (a nested one too: ``GPT2Model``
inside ``GPT2LMHeadModel``) runs it at the end of its construction, in ``post_init``, before tying
its output embeddings to the input ones. :func:`record_skipped_init` runs ``initialize_weights()``
of every such model still on the meta device, recorded as if at the end of its construction (after
its last submodule or parameter was assigned), with its own tied weights untied meanwhile (one
device initialises the head's own weight, then drops it for the embedding's): the draws come in one
device's order, so replay gives one device's values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from spread.errors import SpreadError
from spread.memory.meta_init import MetaInitRecorder


def is_hf_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (told by its methods, so transformers is not imported)."""
    return (
        callable(getattr(module, "initialize_weights", None))
        and callable(getattr(module, "_initialize_weights", None))
        and hasattr(module, "config")
    )


def record_skipped_init(recorder: MetaInitRecorder, modules: Sequence[nn.Module]) -> list[nn.Module]:
    """Record, into ``recorder``'s recording, the initialisation transformers skipped for each
    Hugging Face model among ``modules`` built on the meta device while it recorded; innermost
    first, as one device runs them. Returns those models."""
    recording = recorder.recording
    models = [
        m
        for m in {id(m): m for m in modules}.values()
        if is_hf_model(m)
        and not getattr(m, "_is_hf_initialized", False)
        and recording.registered_at(m) is not None
        and any(p.is_meta for p in m.parameters())
    ]
    models.sort(key=lambda m: recording.registered_at(m) or 0)
    for model in models:
        position = recording.registered_at(model)
        assert position is not None
        initialize_weights: Callable[[], None] = model.initialize_weights  # type: ignore[assignment]
        with recorder.inserted_at(position), _untied(model):
            initialize_weights()
    return models


@contextmanager
def _untied(model: nn.Module) -> Iterator[None]:
    """The model's own tied weights (not its submodels', tied in their own construction) each
    replaced by a fresh meta parameter of the same shape, as before ``tie_weights``; tied back after."""
    own = getattr(model, "get_expanded_tied_weights_keys", None)
    shared = _shared_parameter_names(model)
    if own is None:
        if shared:
            raise SpreadError(
                f"{type(model).__name__} built on the meta device ties weights ({', '.join(shared)}) and "
                "this transformers version does not say which it ties itself; build it on a real device"
            )
        yield
        return
    restore: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for target, source in own(all_submodels=False).items():
            owner_name, _, attribute = target.rpartition(".")
            owner = model.get_submodule(owner_name)
            tied = getattr(owner, attribute)
            if tied is not model.get_parameter(source):
                continue
            restore.append((owner, attribute, tied))
            setattr(owner, attribute, nn.Parameter(torch.empty_like(tied), requires_grad=tied.requires_grad))
        yield
    finally:
        for owner, attribute, tied in reversed(restore):
            setattr(owner, attribute, tied)


def _shared_parameter_names(model: nn.Module) -> set[str]:
    """Names of parameters reachable under a second name (the second and later names)."""
    seen: set[int] = set()
    shared: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            shared.add(name)
        seen.add(id(p))
    return shared
