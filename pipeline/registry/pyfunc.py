"""satp's MLflow pyfunc model: ``mlflow.pyfunc.load_model(uri).predict(inputs)`` on a registered version.

A registered version's ``satp_pyfunc.py`` (:data:`pipeline.registry.model_format.PYFUNC_CODE`, MLflow's
"models from code") imports :class:`SATPyfunc` from here and hands an instance to MLflow; its
artifacts are read by :func:`pipeline.registry.model_format.read_model` and served by
:class:`pipeline.registry.predict.Predictor`. The top of the registry room: it uses the prediction
code, nothing in the registry uses it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import mlflow.pyfunc
import pydantic

from pipeline.registry.model_format import read_model
from pipeline.registry.predict import Predictor


class ModelInput(pydantic.BaseModel):
    """One input of the pyfunc model: Python source text (code2), or a graph in the JSON graph
    format of ``satp predict`` (ppa: ``num_nodes``, ``edge_index``, ``edge_attr``; pattern and
    cluster: ``num_nodes``, ``edge_index``, ``x``)."""

    source: Optional[str] = None
    num_nodes: Optional[int] = None
    edge_index: Optional[list[list[int]]] = None
    edge_attr: Optional[list[list[float]]] = None
    x: Optional[list[int]] = None


class SATPyfunc(mlflow.pyfunc.PythonModel):
    """``mlflow.pyfunc.load_model(uri).predict(inputs)``: one prediction per input, as
    ``satp predict --json`` gives them (code2: a list of ``{"name", "line", "actual",
    "predicted"}`` per source; ppa: a class; pattern / cluster: a class per node)."""

    def load_context(self, context) -> None:
        files = {name: Path(path) for name, path in context.artifacts.items()}
        self.predictor = Predictor(read_model(files["weights"], files["satp_model"], "pyfunc model"))

    # the input's type hint gives MLflow the signature (and validates inputs); no output hint: the
    # output's type depends on the task, and an untyped ``list`` draws MLflow's inference message
    def predict(self, context, model_input: list[ModelInput], params: Optional[dict[str, Any]] = None):
        values = [v.model_dump(exclude_none=True) if isinstance(v, pydantic.BaseModel) else dict(v) for v in model_input]
        return self.predictor.predict_json(values, "model input")
