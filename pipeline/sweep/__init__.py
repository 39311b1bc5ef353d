"""``satp tune`` (:mod:`~pipeline.sweep.tune`, an ASHA sweep) and ``satp compare``
(:mod:`~pipeline.sweep.compare`, variants over seeds): many trainings of one job on Ray Tune, run by
one driver (:mod:`~pipeline.sweep.runner`); each trial is a :func:`pipeline.train.driver.train_job`."""
