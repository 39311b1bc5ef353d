"""``satp train``: one job on Ray Train workers with DeepSpeed, checkpointed, logged and registered.

The driver resolves the job into a read-only plan (:mod:`~pipeline.train.plan`, which decides what
the run name holds with :mod:`~pipeline.train.rerun`), checks it (:mod:`~pipeline.train.preflight`),
handles the MLflow run (:mod:`~pipeline.train.mlflow_run`) and fits Ray Train's trainer
(:mod:`~pipeline.train.driver`). Each worker (:func:`~pipeline.train.driver.worker_main`) runs a
:class:`~pipeline.train.trainer.Trainer` in a :class:`~pipeline.train.context.RayContext`; the same
trainer runs without Ray in a :class:`~pipeline.train.context.LocalContext`.

Sweeps (:mod:`pipeline.sweep`) call this room; it calls only :mod:`pipeline.registry` and the shared
modules below it.
"""
