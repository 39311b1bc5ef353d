"""``satp train``: one job on Ray Train workers with DeepSpeed, checkpointed, logged and registered.

The driver side resolves the job once into a read-only plan (:mod:`~pipeline.train.plan`, which also
decides what the run name already holds, comparing configurations with :mod:`~pipeline.train.rerun`),
checks it before anything costly (:mod:`~pipeline.train.preflight`), opens and closes the run's MLflow
run and registers its best model (:mod:`~pipeline.train.mlflow_run`) and fits Ray Train's trainer
(:mod:`~pipeline.train.driver`). Each Ray Train worker (:mod:`~pipeline.train.worker`) runs a
:class:`~pipeline.train.trainer.Trainer` in a :class:`~pipeline.train.context.RayContext`; the same
trainer runs without Ray in a :class:`~pipeline.train.context.LocalContext`. It composes one-job
components, as torchtitan's trainer does:
:mod:`~pipeline.train.loader` and :mod:`~pipeline.train.batching` (shards into batches),
:mod:`~pipeline.train.engine` (DeepSpeed, precision, optimizer), :mod:`~pipeline.train.step` (one
training step and the evaluation), :mod:`~pipeline.train.metrics`, :mod:`~pipeline.train.precise_bn`,
:mod:`~pipeline.train.stopping` (target and patience) and :mod:`~pipeline.train.checkpoint` (the
one :class:`~pipeline.train.checkpoint.CheckpointManager` that writes, verifies, lists, picks and prunes);
:mod:`~pipeline.train.epoch_logger` logs each reported epoch to MLflow from Ray Train's controller.

Sweeps (:mod:`pipeline.sweep`) call this room; it calls only :mod:`pipeline.registry` and the shared
modules below it.
"""
