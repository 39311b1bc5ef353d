"""What a Ray Train run's processes open on its path, imported ahead in the warm ones.

Every worker process of satp's clusters imports this module when it starts (the raylet's
``RAY_preload_python_modules``: :data:`runtime.worker_pool.PRELOAD_MODULES`). A process the warm
pool started ahead of any job (:func:`prestarted`) of a Train run's kinds, whose environment
carries the variable Ray Train sets on its controller (and so on every actor the controller starts:
:data:`runtime.worker_pool.CONTROLLER_VAR`), imports :data:`RUN_MODULES`, what those processes open
when the run needs them: torch (the controller unpickles its ``TorchConfig``, whose module imports
it), MLflow's SQL store (the controller's epoch logger, :mod:`pipeline.train.epoch_logger`, and rank
0's run logger) and pyplot (the epoch logger's curves). Measured with py-spy on 2 cores,
pattern-local: ~3 s at the run's start, ~1.5 s before the first step and ~3 s after the last epoch,
paid by the warm process instead. A prestarted process of the kinds that train (Train's workers, every process of a
sweep's job: :func:`runtime.worker_pool.training_env`) imports :data:`TRAINING_MODULES` too, in its
setup hook :func:`import_training_modules`.

A process Ray starts for a job's actor or task imports none of it: it imports what its work opens.
Train's synchronization actor (and, in Ray Train runs other than satp's, its placement-group cleaner
and dataset manager) shares the controller's kind (in a sweep also the training kind) and needs none
of these modules: importing them cost 8-11 s of CPU per helper and run where the pool does not
refill (a busy machine; the test suite: 930 s of its CPU). Nothing here is training code: a warm
process runs no stale satp code.
"""
from __future__ import annotations

import importlib
import os
from typing import Iterable

from runtime.worker_pool import CONTROLLER_VAR

RUN_MODULES = ("ray.train.torch", "mlflow.store.tracking.sqlalchemy_store", "matplotlib.pyplot")
#: modules a satp training process needs (torch, PyG, DeepSpeed, Ray Train and through them numpy,
#: pyarrow, pandas, MLflow); satp's own modules are not among them: a worker imports those from the
#: checkout when it runs (~0.2 s), so an edited checkout never runs stale code in a warm process
TRAINING_MODULES = ("ray.train.torch", "torch_geometric", "deepspeed", "runtime.ray_logs")


def import_modules(names: Iterable[str]) -> None:
    """Import each of ``names``."""
    for name in names:
        importlib.import_module(name)


def prestarted() -> bool:
    """Whether Ray started this worker process ahead of any job (the warm pool's ``PrestartWorkers``,
    which names no job: the raylet gives the process the nil job id, all ``f``), not for a job's
    actor or task."""
    job = os.environ.get("RAY_JOB_ID", "")
    return bool(job) and set(job.lower()) == {"f"}


def import_training_modules() -> None:
    """The setup hook of :func:`runtime.worker_pool.training_env`'s processes."""
    if prestarted():
        import_modules(TRAINING_MODULES)


if CONTROLLER_VAR[0] in os.environ and prestarted():
    import_modules(RUN_MODULES)
