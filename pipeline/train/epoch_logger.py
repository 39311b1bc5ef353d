"""Per-epoch MLflow logging from Ray Train's controller, once an epoch's checkpoint is registered.

A worker's ``ray.train.report`` hands its checkpoint to the controller, which registers it when it
next polls the worker group. A worker (or its node) lost between the two resumes from the
checkpoint before, and re-runs the epoch. Had rank 0 logged that epoch itself, MLflow would hold it
twice (once for the lost attempt). The controller calls its report callbacks only after the
checkpoint manager has registered the report, so logging here writes each epoch that the run keeps,
once. What a failed write misses, the next resume catches up from the checkpoint's history
(:meth:`pipeline.registry.tracking.RankZeroLogger.resume`).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from ray.train import UserCallback

from pipeline.registry import tracking

log = logging.getLogger(__name__)


class RegisteredEpochLogger(UserCallback):
    """Log rank 0's metrics of each registered epoch (step = epoch) and the plots of the curves
    (:func:`pipeline.registry.tracking.log_curves`; ``target``: the job's ``train.target``, if any)."""

    def __init__(self, tracking_uri: str, run_id: str, metric: str, target: Optional[dict[str, Any]] = None) -> None:
        self.tracking_uri, self.run_id, self.metric, self.target = tracking_uri, run_id, metric, target
        self._client = None

    def __getstate__(self) -> dict:  # shipped to the controller actor; the client is made there
        return {**self.__dict__, "_client": None}

    @property
    def client(self):
        if self._client is None:
            self._client = tracking.client(self.tracking_uri)
        return self._client

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint: Optional[Any]) -> None:
        # imported here, not with the module: the controller loads this class when it starts, and
        # the checkpoint module brings torch (seconds of a new controller's start on 2 cores)
        from pipeline.train import checkpoint as ckpt

        values = metrics[0] if metrics else {}
        if "epoch" not in values:
            return
        epoch = int(values["epoch"])
        try:
            tracking.log_metrics(self.client, self.run_id, values, step=epoch)
            if checkpoint is not None:
                with checkpoint.as_directory() as directory:
                    history = ckpt.load_state(directory).get("history") or []
                tracking.log_curves(self.client, self.run_id, history, self.metric, self.target)
        except Exception as exc:  # the tracking store must not stop training
            log.warning("MLflow: epoch %d not logged (%s); the next resume catches it up", epoch, exc)
