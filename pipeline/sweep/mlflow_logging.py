"""MLflow for sweeps, with the driver as the only writer: one child run per trial
(params and per-epoch metrics, logged by the Tune callback :class:`SweepLogger`), and the epochs a
trial reported just before an interruption, caught up from its checkpoint."""
from __future__ import annotations

import functools
import time
from typing import Any

from ray.tune import Callback

from pipeline.registry import tracking
from pipeline.sweep.space import apply_config
from pipeline.sweep.summary import checkpoint_history
from pipeline.sweep.trials import SweepContext, release_orphaned_placement_groups


SWEEP_KEY_TAG = "satp.sweep_key"
TRIAL_TAG = "satp.trial_id"
PARENT_TAG = "mlflow.parentRunId"


#: Tune's own bookkeeping in a result: not logged to MLflow as metrics.
_TUNE_KEYS = {
    "training_iteration", "time_this_iter_s", "time_total_s", "timestamp", "pid", "iterations_since_restore",
    "time_since_restore", "done", "timesteps_total", "episodes_total", "timesteps_since_restore",
    "checkpoint_dir_name", "should_checkpoint", "node_ip", "hostname", "date", "experiment_tag", "trial_id",
    "epochs_done",
}


def retire_sweep_runs(client, exp_id: str, sweep_key: str, why: str) -> None:
    """Detach the MLflow runs of a sweep started over (``--restart``) from its key, so that the new
    sweep gets new ones; they stay, tagged with why (``satp.retired``) and the key they had."""
    key = sweep_key.replace("'", "\\'")
    runs, token = [], None
    while True:
        page = client.search_runs([exp_id], filter_string=f"tags.`{SWEEP_KEY_TAG}` = '{key}'", page_token=token)
        runs += page
        token = page.token
        if not token:
            break
    for run in runs:
        tracking.retire(client, run.info.run_id, SWEEP_KEY_TAG, sweep_key, why)


def catch_up_metrics(client, run_id: str, checkpoint_path: str, storage=None) -> None:
    """Log the epochs of a trial's checkpointed history that its MLflow run lacks (reported just
    before an interruption, they never reached the driver's callback)."""
    logged = {int(m.step) for m in client.get_metric_history(run_id, "epoch")}
    for entry in checkpoint_history(checkpoint_path, storage):
        if entry["epoch"] >= 0 and entry["epoch"] not in logged:
            tracking.log_metrics(client, run_id, _metrics(entry), step=entry["epoch"])


def _metrics(values: dict[str, Any]) -> dict[str, Any]:
    """A Tune result or history entry without Tune's bookkeeping and flags."""
    return {k: v for k, v in values.items() if k not in _TUNE_KEYS and not isinstance(v, bool)}


class SweepLogger(Callback):
    """Tune callback in the driver: one MLflow child run per trial (params, per-epoch metrics)."""

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str, sweep_key: str, ctx: SweepContext) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.sweep_key = sweep_key
        self.ctx = ctx
        self._runs: dict[str, str] = {}

    def __getstate__(self):  # Tune pickles its callbacks with the experiment state
        return {**{k: v for k, v in self.__dict__.items() if k != "client"}, "_runs": {}}

    @functools.cached_property
    def client(self):
        return tracking.client(self.tracking_uri)

    def run_id(self, trial) -> str:
        tid = trial.trial_id
        if tid not in self._runs:
            params = apply_config(self.ctx.base, self.ctx.settings(trial.config))
            params["train"]["epochs"] = self.ctx.max_epochs
            self._runs[tid], _ = tracking.reopen_run(self.client, self.experiment_id,
                                                     {SWEEP_KEY_TAG: self.sweep_key, TRIAL_TAG: tid},
                                                     f"{self.ctx.name}-{tid}", params, {PARENT_TAG: self.parent_run_id})
        return self._runs[tid]

    def on_trial_start(self, iteration, trials, trial, **info):
        self.run_id(trial)

    def on_step_begin(self, iteration, trials, **info):
        now = time.monotonic()
        if now - getattr(self, "_last_release", 0.0) > 2.0:
            self._last_release = now
            release_orphaned_placement_groups()

    def on_trial_result(self, iteration, trials, trial, result, **info):
        release_orphaned_placement_groups()  # the trial's workers run: its group is seen in use
        step = int(result.get("epoch", result.get("training_iteration", 1) - 1))
        tracking.log_metrics(self.client, self.run_id(trial), _metrics(result), step=step)

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        epochs = int(last.get("epoch", -1)) + 1
        run_id = self.run_id(trial)
        early = epochs < self.ctx.max_epochs
        self.client.set_tag(run_id, "satp.early_stopped", str(early).lower())
        self.client.set_tag(run_id, "satp.epochs_run", str(epochs))
        self.client.set_terminated(run_id, status="KILLED" if early else "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info):
        run_id = self.run_id(trial)
        self.client.set_tag(run_id, "satp.error", str(getattr(trial, "error_msg", "") or "")[:500])
        self.client.set_terminated(run_id, status="FAILED")
