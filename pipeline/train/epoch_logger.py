"""MLflow logging from Ray Train's controller, once a report's checkpoint is registered: each
epoch's metrics (step = epoch), and each step's loss and worker count (step = global step).

Logged here, not by rank 0: a worker lost between its report and the registration re-runs the epoch,
which MLflow would then hold twice.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from ray.train import UserCallback

from pipeline.registry import tracking

log = logging.getLogger(__name__)


class RegisteredEpochLogger(UserCallback):
    """Log rank 0's metrics of each registered report: its steps' losses and worker count and, at an
    epoch's end, the epoch's metrics and curves (``target``: the job's ``train.target``, if any)."""

    def __init__(self, tracking_uri: str, run_id: str, metric: str, target: Optional[dict[str, Any]] = None) -> None:
        self.tracking_uri, self.run_id, self.metric, self.target = tracking_uri, run_id, metric, target

    def __getstate__(self) -> dict:  # shipped to the controller actor; the client is made there
        return {k: v for k, v in self.__dict__.items() if k != "client"}

    @functools.cached_property
    def client(self):
        return tracking.client(self.tracking_uri)

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint: Optional[Any]) -> None:
        # imported here: the controller loads this class when it starts, and these modules bring torch
        from pipeline.train import checkpoint as ckpt
        from pipeline.train.reporting import STEP_KEYS

        values = metrics[0] if metrics else {}
        steps = values.get("step_losses") or []
        try:
            self._log_steps(steps, values.get("world_size"))
        except Exception as exc:  # the tracking store must not stop training
            log.warning("MLflow: steps %s-%s not logged (%s)", steps[0][0], steps[-1][0], exc)
        if "epoch" not in values:
            return
        epoch = int(values["epoch"])
        try:
            epoch_values = {k: v for k, v in values.items() if k not in STEP_KEYS}  # those are over the global step
            tracking.log_metrics(self.client, self.run_id, epoch_values, step=epoch)
            if checkpoint is not None:
                with checkpoint.as_directory() as directory:
                    history = ckpt.load_state(directory).get("history") or []
                tracking.log_curves(self.client, self.run_id, history, self.metric, self.target)
        except Exception as exc:  # the tracking store must not stop training
            log.warning("MLflow: epoch %d not logged (%s); the next resume catches it up", epoch, exc)

    def _log_steps(self, steps: list[list[float]], world_size: Optional[int]) -> None:
        """``train_step_loss`` and ``world_size`` at each of ``steps`` (``[global step, loss]``), in
        batches of MLflow's limit (1,000 values per call)."""
        import math
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [Metric("train_step_loss", float(loss), now, int(step)) for step, loss in steps if math.isfinite(loss)]
        values += [Metric("world_size", float(world_size), now, int(step)) for step, _ in steps if world_size]
        for start in range(0, len(values), 1000):
            self.client.log_batch(self.run_id, metrics=values[start : start + 1000])
