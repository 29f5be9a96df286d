"""Optimizers that run on the parameter servers, each over the shards that server holds.

Why not ``torch.optim`` itself: a server applies updates to row slices of a table (sparse pushes)
and keeps its state per shard, which ``torch.optim`` cannot do. The dense formulas below are
``torch.optim``'s single-tensor code paths, step for step, so that a server applying dense gradients
computes exactly what ``torch.optim`` would on one device (the sync-mode equivalence rests on it).
Every update here is element-wise, so splitting a variable by rows changes nothing.

Row updates (:meth:`ServerOptimizer.apply_rows`) are *lazy*, like ``torch.optim.SparseAdam`` and
TF's sparse apply ops: only the rows a batch touched have their parameters and state updated. For
plain SGD and Adagrad this equals the dense update (untouched rows get a zero gradient and do not
move); with momentum or Adam, untouched rows would keep moving in the dense version.

An optimizer is described by a JSON spec (:func:`spec_from_torch`), which is what travels to the
servers: ``{"type": "adam", "lr": ..., "betas": [...], ...}``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED = ("sgd", "adagrad", "adam", "adamw")
_TORCH_TYPES = {"SGD": "sgd", "Adagrad": "adagrad", "Adam": "adam", "AdamW": "adamw"}
_FIELDS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adamw": ("lr", "betas", "eps", "weight_decay"),
}


def spec_from_torch(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The server-side spec of a torch optimizer (SGD, Adagrad, Adam, AdamW); refuses the rest.

    All parameter groups must share their hyperparameters (one spec per job).
    """
    kind = _TORCH_TYPES.get(type(optimizer).__name__)
    if kind is None:
        raise ValueError(
            f"ParameterServerStrategy runs the optimizer on the servers and supports "
            f"{sorted(_TORCH_TYPES)}; got {type(optimizer).__name__}"
        )
    specs = []
    for group in optimizer.param_groups:
        for flag in ("maximize", "amsgrad", "differentiable"):
            if group.get(flag):
                raise ValueError(
                    f"{type(optimizer).__name__}({flag}=True) is not supported on parameter servers"
                )
        spec: dict[str, Any] = {"type": kind}
        for field in _FIELDS[kind]:
            value = group[field]
            spec[field] = list(value) if isinstance(value, tuple) else value
            if isinstance(spec[field], torch.Tensor):
                spec[field] = spec[field].item()
        specs.append(spec)
    if any(s != specs[0] for s in specs[1:]):
        raise ValueError("ParameterServerStrategy needs the same hyperparameters in every parameter group")
    return specs[0]


class ServerOptimizer:
    """Applies one optimizer's updates to named shards and keeps their state.

    ``hyper`` (the spec) may change between steps (a learning-rate schedule): every call takes the
    current values; the type may not.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        kind = spec.get("type")
        if kind not in SUPPORTED:
            raise ValueError(f"optimizer type must be one of {SUPPORTED}, got {kind!r}")
        self.kind = kind
        self.spec = dict(spec)
        self.state: dict[str, dict[str, Any]] = {}

    def check_same_kind(self, spec: dict[str, Any]) -> None:
        if spec.get("type") != self.kind:
            raise ValueError(f"this server runs {self.kind}; a worker sent a {spec.get('type')} step")

    # -- dense -------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply_dense(self, name: str, param: torch.Tensor, grad: torch.Tensor, hyper: dict[str, Any]) -> None:
        """One ``torch.optim`` step on the whole shard ``param`` with gradient ``grad``."""
        state = self.state.setdefault(name, {})
        getattr(self, f"_{self.kind}")(param, grad, state, hyper)

    @torch.no_grad()
    def apply_rows(
        self, name: str, param: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, hyper: dict[str, Any]
    ) -> None:
        """A lazy step on the rows ``rows`` (unique, int64) of ``param`` with their gradients ``grad``.

        State lives in full-size buffers (zero, or Adagrad's initial value, until a row is first
        touched); a row's first momentum step therefore uses ``(1 - dampening) * grad`` where dense
        SGD would copy the gradient (the same when ``dampening`` is 0, its default).
        """
        state = self.state.setdefault(name, {})
        for key in self._buffer_names():
            if key not in state:
                fill = float(self.spec.get("initial_accumulator_value", 0.0)) if key == "sum" else 0.0
                state[key] = torch.full_like(param, fill)
        # index_select/index_copy_ rather than ``param[rows]``: the same values, several times faster
        # on a CPU (with indexing, the gather and the scatter are most of a sparse push's cost).
        sub = {key: state[key].index_select(0, rows) for key in self._buffer_names()}
        sub["step"] = state.get("step", 0)
        values = param.index_select(0, rows)
        getattr(self, f"_{self.kind}")(values, grad, sub, hyper)
        param.index_copy_(0, rows, values)
        for key in self._buffer_names():
            state[key].index_copy_(0, rows, sub[key])
        state["step"] = sub["step"]

    def _buffer_names(self) -> tuple[str, ...]:
        if self.kind == "sgd":
            return ("momentum_buffer",) if self.spec.get("momentum") else ()
        return ("sum",) if self.kind == "adagrad" else ("exp_avg", "exp_avg_sq")

    # -- formulas (torch.optim single-tensor paths) ------------------------------------------------
    @staticmethod
    def _sgd(param, grad, state, h) -> None:
        wd, momentum = h.get("weight_decay", 0.0), h.get("momentum", 0.0)
        if wd:
            grad = grad.add(param, alpha=wd)
        if momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = torch.clone(grad).detach()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - h.get("dampening", 0.0))
            state["momentum_buffer"] = buf
            grad = grad.add(buf, alpha=momentum) if h.get("nesterov") else buf
        param.add_(grad, alpha=-h["lr"])

    @staticmethod
    def _adagrad(param, grad, state, h) -> None:
        step = state.get("step", 0) + 1
        state["step"] = step
        if state.get("sum") is None:
            state["sum"] = torch.full_like(param, float(h.get("initial_accumulator_value", 0.0)))
        if h.get("weight_decay"):
            grad = grad.add(param, alpha=h["weight_decay"])
        clr = h["lr"] / (1 + (step - 1) * h.get("lr_decay", 0.0))
        state["sum"].addcmul_(grad, grad, value=1)
        std = state["sum"].sqrt().add_(h.get("eps", 1e-10))
        param.addcdiv_(grad, std, value=-clr)

    @classmethod
    def _adam(cls, param, grad, state, h, decoupled: bool = False) -> None:
        step = state.get("step", 0) + 1
        state["step"] = step
        if state.get("exp_avg") is None:
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        beta1, beta2 = h["betas"]
        wd = h.get("weight_decay", 0.0)
        if decoupled:
            param.mul_(1 - h["lr"] * wd)
        elif wd:
            grad = grad.add(param, alpha=wd)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = h["lr"] / (1 - beta1**step)
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(h["eps"])
        param.addcdiv_(exp_avg, denom, value=-step_size)

    @classmethod
    def _adamw(cls, param, grad, state, h) -> None:
        cls._adam(param, grad, state, h, decoupled=True)

    # -- state -------------------------------------------------------------------------------------
    def state_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """This shard's state as tensors (for checkpoints): buffers and the step count."""
        out = {}
        for key, value in self.state.get(name, {}).items():
            if isinstance(value, torch.Tensor):
                out[key] = value
            elif isinstance(value, int | float):
                out[key] = torch.tensor(value)
        return out

    def load_state_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.state[name] = {
            key: (int(value.item()) if key == "step" else value.clone()) for key, value in tensors.items()
        }
