"""WandbLogger: one Weights & Biases run per job, continued across restores (:mod:`._tracker`).

``wandb`` is an optional dependency (``pip install wandb`` or ``spread[wandb]``), imported when the
callback is built so a missing package is reported before training starts. The run is a run object
of its own (``reinit="create_new"``) and is logged through it, so a run the script opened with
``wandb.init`` is left alone.

As Keras' ``WandbMetricsLogger``: ``epoch/<name>`` against ``epoch/epoch`` (0-based; the straggler
figures are ``epoch/timing/...``) and, every ``log_every_n_steps`` optimizer steps, ``batch/<name>``
against ``batch/step`` (``trainer.global_step``); the job's params go to the run's config. A
resumed fit reopens the run with ``resume="allow"``; online, the run's summary says which points it
holds, so none is logged twice; offline (``mode="offline"``), W&B writes the continuation into a
directory of its own with the same run id, merged by ``wandb sync``, and the steps trained again
after the backup are logged again there. With ``log_checkpoints``, the files a ModelCheckpoint of
the same fit wrote are logged as a ``model`` artifact.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from spread.train.callbacks._tracker import FINISHED, TrackerLogger


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            "WandbLogger needs the `wandb` package, which is not installed. "
            "Install it with `pip install wandb` (or `pip install spread[wandb]`)."
        ) from exc
    return wandb


class WandbLogger(TrackerLogger):
    """Logs params, metrics and (optionally) checkpoints of a fit to one W&B run (on the chief).

    Args:
        project: the W&B project; None: W&B's default (``WANDB_PROJECT``, else "uncategorized").
        name: the run's display name; None lets W&B pick one.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; None: W&B's default (``WANDB_MODE``).
        dir: where W&B writes its files; None: W&B's default (``WANDB_DIR``, else the working directory).
        entity: the W&B user or team; None: the default one.
        tags: tags of the run.
        params: extra config logged with the job's own (strategy, replicas, optimizer, ...).
        log_every_n_steps: log the running train logs every N optimizer steps; None: epochs only.
        log_checkpoints: log the files the fit's ModelCheckpoint callbacks write as an artifact.
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        mode: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        entity: str | None = None,
        tags: Sequence[str] | None = None,
        params: Mapping[str, Any] | None = None,
        log_every_n_steps: int | None = 50,
        log_checkpoints: bool = False,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, log_checkpoints=log_checkpoints, params=params)
        self._wandb = _wandb()
        self.project = project
        self.name = name
        self.mode = mode
        self.dir = os.fspath(dir) if dir is not None else None
        self.entity = entity
        self.tags = list(tags) if tags is not None else None
        self.run: Any = None  # the wandb Run while one is open

    def _init(self, **resume: Any) -> Any:
        run = self._wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.name,
            mode=self.mode,
            dir=self.dir,
            tags=self.tags,
            reinit="create_new",
            **resume,
        )
        run.define_metric("batch/step")
        run.define_metric("batch/*", step_metric="batch/step")
        run.define_metric("epoch/epoch")
        run.define_metric("epoch/*", step_metric="epoch/epoch")
        return run

    def _create_run(self) -> str:
        self.run = self._init()
        return str(self.run.id)

    def _reopen_run(self, run_id: str) -> tuple[int, int]:
        self.run = self._init(id=run_id, resume="allow")
        summary = self.run.summary
        return int(summary.get("batch/step", -1)), int(summary.get("epoch/epoch", -1))

    def _log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def _log_metrics(self, prefix: str, metrics: dict[str, float], step: int) -> None:
        axis = "batch/step" if prefix == "batch" else "epoch/epoch"
        self.run.log({**{f"{prefix}/{k}": v for k, v in metrics.items()}, axis: step})

    def _log_artifact(self, path: str) -> None:
        artifact = self._wandb.Artifact(f"model-{self.run.id}", type="model")
        artifact.add_file(path)
        self.run.log_artifact(artifact)

    def _end_run(self, status: str) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish(exit_code=0 if status == FINISHED else 1)
