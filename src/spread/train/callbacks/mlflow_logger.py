"""MLflowLogger: one MLflow run per job, continued across restores (:mod:`._tracker`).

``mlflow`` is an optional dependency (``pip install mlflow`` or ``spread[mlflow]``), imported when
the callback is built so a missing package is reported before training starts. The callback talks to
the tracking server through ``MlflowClient`` with the run's id, never through mlflow's global
"active run", so it does not disturb runs the script opens itself.

Params once, when the run is created (MLflow's params cannot change, and a resumed job may run at
another world size). Metrics ``epoch/<name>`` (step = 0-based epoch; the straggler figures are
``epoch/timing/...``) and, every ``log_every_n_steps`` optimizer steps, ``batch/<name>`` (step =
``trainer.global_step``). With ``log_checkpoints``, every file a ModelCheckpoint of the same fit
wrote goes to the run's ``checkpoints/`` artifacts (at the next epoch's start and at the end).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from spread.train.callbacks._monitor import invalid
from spread.train.callbacks._tracker import TrackerLogger

_BATCH = 1000  # MLflow's log_batch accepts at most 1000 metrics and 100 params per call


def _mlflow() -> Any:
    try:
        import mlflow
        import mlflow.entities
    except ImportError as exc:
        raise ImportError(
            "MLflowLogger needs the `mlflow` package, which is not installed. "
            "Install it with `pip install mlflow` (or `pip install spread[mlflow]`)."
        ) from exc
    return mlflow


class MLflowLogger(TrackerLogger):
    """Logs params, metrics and (optionally) checkpoints of a fit to one MLflow run (on the chief).

    Args:
        tracking_uri: the tracking server or store (``http://host:5000``, ``sqlite:///mlflow.db``);
            None: MLflow's default (``MLFLOW_TRACKING_URI``, else a local store).
        experiment: the experiment's name (created if missing).
        run_name: the run's name; None lets MLflow pick one.
        tags: tags set on the run when it is created.
        params: extra params logged with the job's own (strategy, replicas, optimizer, ...).
        log_every_n_steps: log the running train logs every N optimizer steps; None: epochs only.
        log_checkpoints: upload the files the fit's ModelCheckpoint callbacks write.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "spread",
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        log_every_n_steps: int | None = 50,
        log_checkpoints: bool = False,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, log_checkpoints=log_checkpoints, params=params)
        if not isinstance(experiment, str) or not experiment:
            raise invalid("experiment", experiment, "a non-empty string")
        self._mlflow = _mlflow()
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The ``MlflowClient`` the callback logs through (made on first use, on the chief)."""
        if self._client is None:
            self._client = self._mlflow.MlflowClient(self.tracking_uri)
        return self._client

    def _create_run(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        return str(run.info.run_id)

    def _reopen_run(self, run_id: str) -> tuple[int, int]:
        self.client.update_run(run_id, status="RUNNING")
        last = {"batch": -1, "epoch": -1}
        for key in self.client.get_run(run_id).data.metrics:
            prefix = key.split("/", 1)[0]
            if prefix in last:
                steps = (m.step for m in self.client.get_metric_history(run_id, key))
                last[prefix] = max([last[prefix], *steps])
        return last["batch"], last["epoch"]

    def _log_params(self, params: dict[str, Any]) -> None:
        entries = [self._mlflow.entities.Param(k, str(v)) for k, v in params.items()]
        for start in range(0, len(entries), 100):
            self.client.log_batch(self.run_id, params=entries[start : start + 100])

    def _log_metrics(self, prefix: str, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        entries = [self._mlflow.entities.Metric(f"{prefix}/{k}", v, now, step) for k, v in metrics.items()]
        for start in range(0, len(entries), _BATCH):
            self.client.log_batch(self.run_id, metrics=entries[start : start + _BATCH])

    def _log_artifact(self, path: str) -> None:
        self.client.log_artifact(self.run_id, path, artifact_path="checkpoints")

    def _end_run(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
