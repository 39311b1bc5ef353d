"""The best trial of a sweep registered from its checkpoint (the best epoch's weights), into its
child run; the champion alias moves to it only if it beats the current champion's validation metric."""
from __future__ import annotations

from typing import Any

from pipeline.config import JobConfig
from pipeline.registry import tracking
from pipeline.registry.versions import CHAMPION, promote
from pipeline.sweep.space import variant_key
from pipeline.sweep.summary import TrialSummary
from pipeline.sweep.trials import SweepContext, trial_job

#: the parent run's record of what it registered (``<trial id>/<version>``): a rerun registers nothing again
REGISTERED_TAG = "satp.registered_version"


def register_best(job: JobConfig, best: TrialSummary, ctx: SweepContext, *, task_metric_name: str, mode: str,
                  tracking_uri: str, parent_run_id: str) -> dict[str, Any]:
    """Log the best trial's best-epoch model into its child run, register it, and move the
    champion alias to it if it beats the current champion's validation metric."""
    from pipeline.train import checkpoint as ckpt
    from pipeline.tasks import make_task
    from pipeline.train.loader import open_split
    from pipeline.train.mlflow_run import register_weights

    if not best.checkpoint_path:
        raise RuntimeError(f"trial {best.trial_id} reported no checkpoint")
    storage = job.storage.settings()
    checkpoints, name = ckpt.checkpoint_at(best.checkpoint_path, storage)
    state, weights = checkpoints.load(name)
    if weights is None:
        raise RuntimeError(f"{best.checkpoint_path}: no best weights in the trial's checkpoint")
    shard_dir, sweep_name = ctx.shard_dirs[variant_key(best.config, ctx.data_keys)], ctx.name
    extra = {"run_name": f"{sweep_name}-{best.trial_id}",
             "job": trial_job(ctx, best.config, best.trial_id).model_dump(mode="json"),
             "sweep": {"name": sweep_name, "trial_id": best.trial_id, "parent_run_id": parent_run_id}}
    train = open_split(shard_dir, "train", storage)
    task_state = dict(state["task"])
    task = make_task(task_state.pop("name"), vocab=train.vocab, **task_state)
    reg, _ = register_weights(job, task, state, weights, run_id=best.run_id, shard_dir=shard_dir,
                              manifest_hash=(train.manifest or {}).get("config_hash", ""), extra=extra)
    name = reg["registered_model"]
    client = tracking.client(tracking_uri)
    client.set_model_version_tag(name, str(reg["version"]), "satp.sweep", sweep_name)
    reg.update(promote(client, name, reg["version"], state["best"]["val"], f"best_val_{task_metric_name}", mode,
                       CHAMPION, sweep_name))
    return reg
