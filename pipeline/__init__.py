"""satp's pipeline: train, sweep, register and serve SAT models on Ray, DeepSpeed and MLflow.

Rooms, each importing only from those below it (``tests/test_layering.py``): ``cli/``, ``sweep/``,
``train/``, ``registry/``, and the shared ``config/``, ``tasks.py``, ``console.py``, ``pyg_templates.py``.
"""
