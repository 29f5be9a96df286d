"""Training loops: the Keras-style Trainer, metrics reduced across replicas, and callbacks."""

from spread.train import callbacks
from spread.train.metrics import resolve_metrics
from spread.train.trainer import Trainer

__all__ = ["Trainer", "callbacks", "resolve_metrics"]
