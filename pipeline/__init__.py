"""satp's pipeline: train, sweep, register and serve SAT models on Ray, DeepSpeed and MLflow.

The folders are named after what a user does; each imports only from the rooms below it::

    cli/        the ``satp`` command: parses arguments, reads the job, calls one room below
    sweep/      ``satp tune`` (Ray Tune + ASHA over a job) and ``satp compare`` (variants x seeds)
    train/      ``satp train``: the driver (plan, pre-flight, rerun decision, Ray Train fit) and
                the worker with its components (loader, batching, engine, step, checkpoint, ...)
    registry/   MLflow: runs and their metrics, the registered model's files, look-up and predict
    config/     the job file (``load_job``) and its sections' schemas, read by every room
    tasks.py    one object per task (encoder, head, loss, metric), read by every room
    console.py  progress bars and terminal output, set up once by the CLI
    pyg_templates.py  PyG's generated modules kept in memory (every process that builds a model)

Below ``pipeline`` lie :mod:`preprocessing` (datasets into Arrow shards), :mod:`runtime` (the Ray
connection and interrupts, shared with preprocessing) and :mod:`sat` (the model); none of them
imports ``pipeline``.
"""
