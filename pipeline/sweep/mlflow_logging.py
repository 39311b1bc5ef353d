"""MLflow for sweeps, with the driver as the only writer: the parent run, one child run per trial
(params and per-epoch metrics, logged by the Tune callback :class:`SweepLogger`), and the epochs a
trial reported just before an interruption, caught up from its checkpoint."""
from __future__ import annotations

import json
import math
import time
from typing import Any, Optional

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


def open_parent_run(client, exp_id: str, sweep_key: str, kind: str, name: str, params: dict,
                    tags: Optional[dict[str, str]] = None) -> str:
    """The parent MLflow run of a sweep or comparison (``kind``), made before any trial starts (one
    writer: the driver). A rerun finds it by its key and sets it RUNNING again."""
    parent = tracking.find_run(client, exp_id, {SWEEP_KEY_TAG: sweep_key, "satp.kind": kind})
    if parent is None:
        run_tags = {SWEEP_KEY_TAG: sweep_key, "satp.kind": kind, **(tags or {})}
        parent_id = client.create_run(exp_id, run_name=name, tags=run_tags).info.run_id
        tracking.log_params(client, parent_id, params)
        return parent_id
    if parent.info.status != "RUNNING":
        client.update_run(parent.info.run_id, status="RUNNING")
    return parent.info.run_id


def retire_sweep_runs(client, exp_id: str, sweep_key: str, why: str) -> int:
    """Detach the MLflow runs of a sweep started over (``--restart``: its parent and child runs)
    from its key, so that the new sweep gets new ones; they stay, with their params, metrics and
    registered versions, tagged with why (``satp.retired``) and the key they had. Returns how many."""
    key = sweep_key.replace("'", "\\'")
    runs, token = [], None
    while True:
        page = client.search_runs([exp_id], filter_string=f"tags.`{SWEEP_KEY_TAG}` = '{key}'", page_token=token)
        runs += page
        token = page.token
        if not token:
            break
    retired = f"{sweep_key}#retired-{int(time.time())}"
    for run in runs:
        client.set_tag(run.info.run_id, SWEEP_KEY_TAG, retired)
        client.set_tag(run.info.run_id, "satp.retired_sweep_key", sweep_key)
        client.set_tag(run.info.run_id, "satp.retired", why)
    return len(runs)


def catch_up_metrics(client, run_id: str, checkpoint_path: str, storage=None) -> int:
    """Log the epochs of a trial's Train history (its last checkpoint's ``state.json``) that its
    MLflow run lacks: an epoch reported just before an interruption never reached the driver's
    callback. Returns the number of epochs logged."""
    from mlflow.entities import Metric

    history = checkpoint_history(checkpoint_path, storage)
    logged = {int(m.step) for m in client.get_metric_history(run_id, "epoch")}
    now = int(time.time() * 1000)
    count = 0
    for entry in history:
        epoch = entry["epoch"]
        if epoch < 0 or epoch in logged:
            continue
        items = [Metric(k, v, now, epoch) for k, v in _numeric(entry).items()]
        if items:
            client.log_batch(run_id, metrics=items)
            count += 1
    return count


def _numeric(values: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in values.items():
        if k in _TUNE_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class SweepLogger(Callback):
    """Tune callback in the driver: one MLflow child run per trial (params, per-epoch metrics)."""

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str, sweep_key: str, ctx: SweepContext) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.sweep_key = sweep_key
        self.ctx = ctx
        self._runs: dict[str, str] = {}
        self._client = None

    def __getstate__(self):  # Tune pickles its callbacks with the experiment state
        state = self.__dict__.copy()
        state["_client"] = None
        state["_runs"] = {}
        return state

    @property
    def client(self):
        if self._client is None:
            self._client = tracking.client(self.tracking_uri)
        return self._client

    def run_id(self, trial) -> str:
        tid = trial.trial_id
        if tid in self._runs:
            return self._runs[tid]
        client = self.client
        found = tracking.find_run(client, self.experiment_id, {SWEEP_KEY_TAG: self.sweep_key, TRIAL_TAG: tid})
        if found is not None:
            run_id = found.info.run_id
            if found.info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
        else:
            tags = {PARENT_TAG: self.parent_run_id, SWEEP_KEY_TAG: self.sweep_key, TRIAL_TAG: tid,
                    "satp.trial_config": json.dumps(trial.config, default=str)[:5000]}
            run = client.create_run(self.experiment_id, run_name=f"{self.ctx.name}-{tid}", tags=tags)
            run_id = run.info.run_id
            params = apply_config(self.ctx.base, trial.config)
            params["train"]["epochs"] = self.ctx.max_epochs
            tracking.log_params(client, run_id, params)
        self._runs[tid] = run_id
        return run_id

    def on_trial_start(self, iteration, trials, trial, **info):
        self.run_id(trial)

    def on_step_begin(self, iteration, trials, **info):
        now = time.monotonic()
        if now - getattr(self, "_last_release", 0.0) > 2.0:
            self._last_release = now
            release_orphaned_placement_groups()

    def on_trial_result(self, iteration, trials, trial, result, **info):
        from mlflow.entities import Metric

        release_orphaned_placement_groups()  # the trial's workers run: its group is seen in use

        metrics = _numeric(result)
        step = int(result.get("epoch", result.get("training_iteration", 1) - 1))
        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        if items:
            self.client.log_batch(self.run_id(trial), metrics=items)

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
