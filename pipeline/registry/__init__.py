"""MLflow: training runs, the registered model's files, look-up by name and prediction.

:mod:`~pipeline.registry.tracking` opens, logs and closes runs; :mod:`~pipeline.registry.model_format`
is what a registered version holds (weights and a JSON description, nothing pickled);
:mod:`~pipeline.registry.versions` logs, registers, promotes and loads versions;
:mod:`~pipeline.registry.predict` turns a registered model back into predictions on new inputs, and
:mod:`~pipeline.registry.pyfunc` serves them through MLflow's pyfunc interface.
Training (:mod:`pipeline.train`) and sweeps (:mod:`pipeline.sweep`) call this room; it calls neither.
"""
