"""Export: the trained weights as files other tools read, from any strategy.

The one-device weights come from ``strategy.full_state_dict(model)`` (the state seam: gathered from
shards or pipeline stages, pulled from parameter servers), so the call is collective where that one
is and every rank makes it; only the chief writes. :func:`save_safetensors` writes one
``.safetensors`` file through the project's atomic writer; :func:`save_pretrained` writes a Hugging
Face model in ``save_pretrained``'s layout (config and weights), loadable with ``from_pretrained``.

The strategy is a :class:`ExportSource` here (a ``Protocol``): this layer sits below
``spread.strategies`` and needs only these two members of the contract.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, NoReturn, Protocol

import torch
from torch import nn

from spread.checkpoint.atomic import atomic_save, fsync_directory_if_possible, fsync_path

SAFETENSORS_SUFFIX = ".safetensors"

# Arguments of ``PreTrainedModel.save_pretrained`` that :func:`save_pretrained` decides itself.
_DECIDED_HERE = {
    "state_dict": "the one-device weights come from strategy.full_state_dict(model)",
    "is_main_process": "the strategy's chief writes",
    "distributed_checkpoint": "the weights are gathered to the chief, not written per rank",
    "push_to_hub": "the files are written to a temporary directory first; push the directory afterwards",
}


class ExportSource(Protocol):
    """What export needs of a strategy (``spread.Strategy`` is one)."""

    @property
    def is_chief(self) -> bool: ...

    def full_state_dict(self, obj: nn.Module) -> dict[str, Any]: ...


def write_safetensors(state: Mapping[str, Any], f: IO[bytes]) -> None:
    """safetensors bytes of a one-device ``state_dict``: each tensor its own contiguous copy on the
    CPU (tied weights share storage, which safetensors refuses; both names are written), with the
    ``format: pt`` metadata Hugging Face's loaders check."""
    from safetensors.torch import save

    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"safetensors holds tensors only: state_dict entry {name!r} is a {type(value).__name__}"
            )
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    f.write(save(tensors, metadata={"format": "pt"}))


def save_safetensors(strategy: ExportSource, model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``model``'s one-device weights to the safetensors file ``path`` (read back with
    ``safetensors.torch.load_file``, loadable into the model on one device).

    Collective wherever ``strategy.full_state_dict`` is (ShardedStrategy, PipelineStrategy): call it
    on every rank. The chief writes atomically (``path`` holds its previous content or the whole new
    file; a full disk raises ``OSError`` naming ``path``); the other ranks return once their part is
    done. Parameter servers: any task may call it; the chief pulls the servers' weights and writes.
    """
    state = strategy.full_state_dict(model)
    if strategy.is_chief:
        atomic_save(state, path, write_safetensors)


def save_pretrained(
    strategy: ExportSource, model: nn.Module, directory: str | os.PathLike[str], **kwargs: Any
) -> None:
    """Write a Hugging Face ``PreTrainedModel`` in ``save_pretrained``'s layout (``config.json``,
    ``model.safetensors`` or its shards and index), so that ``from_pretrained(directory)`` loads the
    trained weights, from any strategy.

    ``model.save_pretrained`` alone writes ``model.state_dict()``, which is not the trained model
    everywhere (ShardedStrategy at ``"parameters"`` releases the weights between steps and refuses
    it); here the chief passes ``strategy.full_state_dict(model)``, with the model's tied weights
    tied again (``lm_head`` is written once, as ``save_pretrained`` does). Collective like
    :func:`save_safetensors`. ``kwargs`` go to ``save_pretrained`` (``max_shard_size``,
    ``variant``, ...). The files are written into a temporary directory inside ``directory``, fsync'ed
    and renamed into place one by one, so a failure while writing (a full disk: ``OSError`` naming
    ``directory``) leaves what was there; weight files of an earlier export that this one does not
    replace are removed, so ``from_pretrained`` cannot mix the two.
    """
    pretrained = _check_pretrained(model, directory)
    for name, why in _DECIDED_HERE.items():
        if name in kwargs:
            raise TypeError(f"spread.export.save_pretrained does not take {name}=: {why}")
    state = strategy.full_state_dict(model)
    if not strategy.is_chief:
        return
    state = _tied_again(model, state)
    target = Path(directory)
    try:
        target.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".spread-export-", dir=target))
    except OSError as exc:
        _raise_naming(exc, target)
    from safetensors import SafetensorError

    try:
        try:
            pretrained.save_pretrained(staging, state_dict=state, **kwargs)
            written = sorted(p.name for p in staging.iterdir())
            for name in written:
                fsync_path(staging / name)
        except OSError as exc:
            _raise_naming(exc, target)
        except SafetensorError as exc:  # its Rust writer reports a full disk as text
            cause = _OS_ERROR_TEXT.search(str(exc))
            if cause is None:
                raise
            _raise_naming(OSError(int(cause.group(2)), cause.group(1)), target, exc)
        # Weights first, the index next, the config last: a reader sees new weights under an old
        # config only if this process dies between two renames.
        for name in sorted(written, key=_rename_order):
            os.replace(staging / name, target / name)
        for stale in _stale_weight_files(target, written):
            stale.unlink()
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
    fsync_directory_if_possible(target)


def _check_pretrained(model: nn.Module, directory: str | os.PathLike[str]) -> Any:
    """``model`` as a ``PreTrainedModel`` (transformers is not typed), or refused: not a Hugging Face
    model (every rank raises, before the collective), or a directory that is a file (there
    ``save_pretrained`` logs an error and returns)."""
    transformers = sys.modules.get("transformers")  # not imported: the model cannot be one of its classes
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(
            f"save_pretrained needs a Hugging Face transformers.PreTrainedModel, got {type(model).__name__}; "
            "for any other model use spread.export.save_safetensors(strategy, model, path)"
        )
    if os.path.exists(directory) and not os.path.isdir(directory):
        shown = os.fspath(directory)
        raise NotADirectoryError(f"save_pretrained writes a directory, and {shown!r} is a file")
    return model


def _tied_again(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the entries of one shared parameter or buffer of ``model`` (GPT-2's ``wte`` and
    ``lm_head``) sharing one tensor again: a gathered state holds separate copies, and
    ``save_pretrained`` recognises ties by shared storage when it drops the tied names."""
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)
    state = dict(state)
    for group in names.values():
        present = [n for n in group if n in state]
        for alias in present[1:]:
            state[alias] = state[present[0]]
    return state


def _rename_order(name: str) -> int:
    if name.endswith(SAFETENSORS_SUFFIX):
        return 0
    return 1 if name.endswith(".index.json") else 2


def _stale_weight_files(target: Path, written: list[str]) -> list[Path]:
    """Weight files of an earlier export of the same name stem (``model``, ``model.<variant>``) that
    this one did not write: a leftover ``model.safetensors`` beside a new sharded index would be
    loaded instead of it."""
    stems = {m.group(1) for name in written if (m := _WEIGHT_FILE.fullmatch(name))}
    return sorted(
        p
        for p in target.iterdir()
        if p.is_file()
        and p.name not in written
        and (m := _WEIGHT_FILE.fullmatch(p.name)) is not None
        and m.group(1) in stems
    )


_WEIGHT_FILE = re.compile(r"(model(?:\.[^.]+)?)(?:-\d{5}-of-\d{5})?\.safetensors(?:\.index\.json)?")


_OS_ERROR_TEXT = re.compile(r"I/O error: (.*) \(os error (\d+)\)")


def _raise_naming(exc: OSError, directory: Path, cause: BaseException | None = None) -> NoReturn:
    """Raise ``exc`` as itself but naming the export's directory, not its temporary one."""
    if exc.errno is None:
        raise exc
    raise type(exc)(exc.errno, exc.strerror, os.fspath(directory)) from cause or exc
