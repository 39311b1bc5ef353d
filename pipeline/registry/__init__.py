"""MLflow: training runs (:mod:`~pipeline.registry.tracking`), a registered model's files
(:mod:`~pipeline.registry.model_format`), registering and loading versions
(:mod:`~pipeline.registry.versions`), prediction (:mod:`~pipeline.registry.predict`,
:mod:`~pipeline.registry.pyfunc`). Training and sweeps call this room; it calls neither."""
