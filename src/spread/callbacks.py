"""``spread.callbacks``: the Trainer's Keras-style callbacks under the name Keras users write.

``from spread.callbacks import EarlyStopping`` and ``spread.callbacks.EarlyStopping`` name the same
class; the callbacks themselves live in :mod:`spread.train.callbacks` (the ``train`` layer), and this
module only makes that public name importable as written.
"""

from spread.train.callbacks import (
    EMA,
    BackupAndRestore,
    Callback,
    CallbackList,
    CSVLogger,
    EarlyStopping,
    History,
    LearningRateScheduler,
    Logs,
    MLflowLogger,
    ModelCheckpoint,
    ProgressBar,
    TensorBoard,
    WandbLogger,
)

__all__ = [
    "BackupAndRestore",
    "Callback",
    "CallbackList",
    "CSVLogger",
    "EarlyStopping",
    "EMA",
    "History",
    "LearningRateScheduler",
    "Logs",
    "MLflowLogger",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoard",
    "WandbLogger",
]
