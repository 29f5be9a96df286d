"""The callback protocol of :class:`spread.Trainer`, Keras-shaped so tf.keras users feel at home.

Contract: every rank calls every hook with the same ``logs`` (metrics are reduced across replicas
before callbacks see them), so decisions taken from logs (early stopping, best checkpoint) agree on
all ranks without extra communication. Callbacks that write files or print set ``chief_only = True``:
the trainer calls them on the chief only. A callback that needs collective work on every rank (for
example saving sharded state) keeps ``chief_only = False`` and checks ``trainer.is_chief`` itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from spread.train.trainer import Trainer

Logs = dict[str, Any]


class Callback:
    """Base class: override the hooks you need; all default to doing nothing.

    Available through ``self.trainer`` once attached: ``model``, ``optimizer``, ``strategy``,
    ``is_chief``, ``stop_training`` (set True to stop after the current epoch), ``params``
    (``epochs``, ``steps`` per epoch or None, ``global_batch_size``, ``verbose``),
    ``epoch`` and ``global_step`` (optimizer steps taken so far).
    """

    chief_only: bool = False
    # A callback that sets the optimizer's learning rate (LearningRateScheduler) says so: the Trainer
    # then puts the rate in the logs as ``lr``, before History and the other callbacks see them.
    sets_learning_rate: bool = False

    def __init__(self) -> None:
        self._trainer: Trainer | None = None

    @property
    def trainer(self) -> Trainer:
        """The trainer this callback is attached to (by ``fit``, ``evaluate`` or ``predict``)."""
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer yet")
        return self._trainer

    def set_trainer(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def runs_on(self, trainer: Trainer) -> bool:
        """Whether ``trainer``'s rank calls this callback: every rank, or the chief when ``chief_only``."""
        return trainer.is_chief or not self.chief_only

    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_fit_exit(self) -> None:
        """``fit`` is leaving, normally (after ``on_train_end``) or by an exception: release what
        ``on_train_begin`` took (a signal handler, a file)."""

    def asks_to_stop(self) -> bool:
        """Whether this process asks every rank to stop after the current training step (a SIGTERM
        it received). Read once per step; the votes travel with the step's statistics, so the
        ranks agree without a collective of their own (``trainer.stop_voted`` after the step)."""
        return False

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_begin(self, step: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None: ...
    def state_dict(self) -> dict[str, Any]:
        """This callback's part of the Trainer's state (``Trainer.state_dict``, which
        :class:`~spread.callbacks.BackupAndRestore` saves), so that a resumed ``fit`` continues it
        exactly: tensors, numbers, strings, and lists or dicts of them (loaded with
        ``weights_only=True``). ``{}`` (the default): nothing to save.

        Called at every backup on every rank the callback runs on, in the same order on every rank,
        so it may run collectives; the chief's result is the one written.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned: called on every rank that reads the backup
        (whether this callback runs there or not), after every callback's ``on_train_begin`` (so a
        callback that starts afresh there keeps what is restored) and before the first step."""
        if state:
            raise NotImplementedError(f"{type(self).__name__} saves state but does not load it")

    def evaluation_weights(self) -> AbstractContextManager[None]:
        """Entered by the Trainer around ``evaluate``, ``predict`` and ``fit``'s validation: a callback
        that evaluates with other weights (:class:`~spread.callbacks.EMA`) swaps them in here and back
        on exit. Default: the model as it is."""
        return nullcontext()

    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_test_batch_end(self, step: int, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...


class CallbackList:
    """Dispatches each hook to the callbacks that should run on this rank, in order."""

    def __init__(self, callbacks: Iterable[Callback], trainer: Trainer) -> None:
        self.callbacks = [cb for cb in callbacks if cb.runs_on(trainer)]
        for cb in self.callbacks:
            cb.set_trainer(trainer)

    def __iter__(self):
        return iter(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)
