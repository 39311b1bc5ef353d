"""``satp tune`` and ``satp compare``: many trainings of one job, on Ray Tune.

:mod:`~pipeline.sweep.tune` runs a hyperparameter sweep (ASHA), :mod:`~pipeline.sweep.compare` a
fixed set of variants over seeds. Both share the trial machinery: the search space
(:mod:`~pipeline.sweep.space`), the trials on the cluster (:mod:`~pipeline.sweep.trials`), their
MLflow runs (:mod:`~pipeline.sweep.mlflow_logging`), the summary and plot
(:mod:`~pipeline.sweep.summary`) and the registration of the best trial
(:mod:`~pipeline.sweep.registration`). Each trial is a :func:`pipeline.train.driver.train_job`.
"""
