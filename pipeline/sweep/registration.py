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
    import torch

    from pipeline.train import checkpoint as ckpt
    from pipeline.registry.predict import input_spec
    from pipeline.registry.versions import register
    from pipeline.tasks import make_task
    from pipeline.train.loader import open_split
    from pipeline.train.engine import build_model
    from sat.config import SATConfig

    if not best.checkpoint_path:
        raise RuntimeError(f"trial {best.trial_id} reported no checkpoint")
    storage = job.storage.settings()
    checkpoints, name = ckpt.checkpoint_at(best.checkpoint_path, storage)
    state, weights = checkpoints.load(name)
    if weights is None:
        raise RuntimeError(f"{best.checkpoint_path}: no best weights in the trial's checkpoint")
    config = SATConfig.from_dict(state["model_config"])
    model = build_model(config)
    model.load_state_dict(weights)
    model.eval()
    shard_dir, sweep_name = ctx.shard_dirs[variant_key(best.config, ctx.data_keys)], ctx.name
    extra = {"run_name": f"{sweep_name}-{best.trial_id}",
             "job": trial_job(ctx, best.config, best.trial_id).model_dump(mode="json"),
             "sweep": {"name": sweep_name, "trial_id": best.trial_id, "parent_run_id": parent_run_id},
             **input_spec(shard_dir, storage)}
    train = open_split(shard_dir, "train", storage)
    vocab, manifest_hash = train.vocab, (train.manifest or {}).get("config_hash", "")
    task_state = dict(state["task"])
    task = make_task(task_state.pop("name"), vocab=vocab, **task_state)
    with torch.no_grad():
        reg = register(model, job=job, task=task, model_config=config, best=state["best"],
                       constant=state.get("constant"), run_id=best.run_id, tracking_uri=tracking_uri,
                       data_manifest_hash=manifest_hash, extra=extra, provenance=state.get("provenance"))
    name = reg["registered_model"]
    client = tracking.client(tracking_uri)
    client.set_model_version_tag(name, str(reg["version"]), "satp.sweep", sweep_name)
    reg.update(promote(client, name, reg["version"], state["best"]["val"], f"best_val_{task_metric_name}", mode,
                       CHAMPION, sweep_name))
    return reg
