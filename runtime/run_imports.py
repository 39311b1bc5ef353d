"""What a Ray Train run's processes open on its path, imported ahead in the warm ones.

Every worker process of satp's clusters imports this module when it starts (the raylet's
``RAY_preload_python_modules``: :data:`runtime.worker_pool.PRELOAD_MODULES`). In a process of a
Train run's kinds, whose environment carries the variable Ray Train sets on its controller (and so
on every actor the controller starts: :data:`runtime.worker_pool.CONTROLLER_VAR`), it imports what
those processes open when the run needs them: torch (the controller unpickles its
``TorchConfig``, whose module imports it), MLflow's SQL store (the controller's epoch logger,
:mod:`pipeline.train.epoch_logger`, and rank 0's run logger) and pyplot (the epoch logger's
curves). Measured with py-spy on 2 cores, pattern-local: ~3 s at the run's start, ~1.5 s before
the first step and ~3 s after the last epoch, paid by the warm process instead. Other processes
(a preprocessing task, a Tune trial actor) import nothing here: on a busy machine, where the pool
does not refill, they start as light as before. It holds no training code: a warm process that
imported it runs no stale satp code.
"""
from __future__ import annotations

import os

from runtime.worker_pool import CONTROLLER_VAR, import_modules

MODULES = ("ray.train.torch", "mlflow.store.tracking.sqlalchemy_store", "matplotlib.pyplot")

if CONTROLLER_VAR[0] in os.environ:
    import_modules(MODULES)
