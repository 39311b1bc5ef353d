"""satp's pipeline: train, sweep, register and serve SAT models on Ray, DeepSpeed and MLflow.

Rooms, each importing only from those below it: ``cli/`` (the ``satp`` command), ``sweep/``
(``satp tune``, ``satp compare``), ``train/`` (``satp train``: driver and worker), ``registry/``
(MLflow runs, registered models, prediction), and what every room reads: ``config/`` (job files),
``tasks.py``, ``console.py``, ``pyg_templates.py``. Below ``pipeline`` lie :mod:`preprocessing`,
:mod:`runtime` and :mod:`sat`, none of which imports it.
"""
