"""Where registered versions written before the reorganisation find their pyfunc class.

Each registered version carries a ``satp_pyfunc.py`` (MLflow's "models from code") naming the
module of :class:`~pipeline.registry.pyfunc.SATPyfunc`; versions registered before it moved
into :mod:`pipeline.registry` name this one, and ``mlflow.pyfunc.load_model`` must keep loading them.
"""
from pipeline.registry.pyfunc import SATPyfunc

__all__ = ["SATPyfunc"]
