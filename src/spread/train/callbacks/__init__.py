"""Callbacks for :class:`spread.Trainer`, named and shaped like ``keras.callbacks``.

Chief-only callbacks (ProgressBar, CSVLogger, TensorBoard, MLflowLogger, WandbLogger) print, write
files or talk to a tracker on the chief process; ModelCheckpoint runs on every rank and the chief
writes; EarlyStopping runs on every rank so that all ranks stop at the same epoch, and EMA keeps
the same average of the weights on every rank.
"""

from spread.train.callbacks.backup_and_restore import BackupAndRestore
from spread.train.callbacks.base import Callback, CallbackList, Logs
from spread.train.callbacks.csv_logger import CSVLogger
from spread.train.callbacks.early_stopping import EarlyStopping
from spread.train.callbacks.ema import EMA
from spread.train.callbacks.history import History
from spread.train.callbacks.lr_scheduler import LearningRateScheduler
from spread.train.callbacks.mlflow_logger import MLflowLogger
from spread.train.callbacks.model_checkpoint import ModelCheckpoint
from spread.train.callbacks.progress import ProgressBar
from spread.train.callbacks.tensorboard import TensorBoard
from spread.train.callbacks.wandb_logger import WandbLogger

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
