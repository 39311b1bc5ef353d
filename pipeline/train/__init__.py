"""``satp train``: one job on Ray Train workers with DeepSpeed, checkpointed, logged and registered.

The driver (:mod:`~pipeline.train.driver`) fits Ray Train's trainer from a read-only plan
(:mod:`~pipeline.train.plan`); each worker runs a :class:`~pipeline.train.trainer.Trainer`, which
also runs without Ray (:class:`~pipeline.train.context.LocalContext`).
"""
