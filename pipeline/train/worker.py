"""The Ray Train worker: ``train_loop_per_worker`` of the TorchTrainer that :func:`pipeline.train.driver.train_job`
fits (through :func:`pipeline.train.driver.worker_main`): a :class:`~pipeline.train.trainer.Trainer` in a
:class:`~pipeline.train.context.RayContext`."""
from __future__ import annotations


def worker_loop(config: dict) -> None:
    """``train_loop_per_worker`` of the TorchTrainer (``config = {"setup": WorkerSetup}``)."""
    from pipeline.train.context import RayContext
    from pipeline.train.trainer import Trainer

    setup = config["setup"]
    Trainer(setup, RayContext(setup.job)).fit()
