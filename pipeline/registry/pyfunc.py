"""satp's MLflow pyfunc model (``mlflow.pyfunc.load_model(uri).predict(inputs)``, ``mlflow models
serve``), through :class:`pipeline.registry.predict.Predictor`. A request is capped and stopped at its
deadline (:mod:`pipeline.registry.limits`); a refusal answers 413 (a cap), 400 (bad input) or 504
(the deadline) with satp's one line as the whole message (:class:`RequestRefused`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import mlflow.pyfunc
import pydantic
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import DEADLINE_EXCEEDED, INVALID_PARAMETER_VALUE, REQUEST_LIMIT_EXCEEDED

from pipeline.registry.limits import Budget, Limits, PastDeadline, TooLarge
from pipeline.registry.model_format import read_model
from pipeline.registry.predict import Predictor


class ModelInput(pydantic.BaseModel):
    """One pyfunc input: Python source (code2) or a JSON graph as ``satp predict`` reads them."""

    source: Optional[str] = None
    num_nodes: Optional[int] = None
    edge_index: Optional[list[list[int]]] = None
    edge_attr: Optional[list[list[float]]] = None
    x: Optional[list[int]] = None


class RequestRefused(MlflowException):
    """A request the model does not serve: answered ``status`` with ``line`` as the whole message (MLflow's
    scoring server prefixes ``message`` with the whole input, so the answer is built from ``line``)."""

    CODES = {400: INVALID_PARAMETER_VALUE, 413: REQUEST_LIMIT_EXCEEDED, 504: DEADLINE_EXCEEDED}

    def __init__(self, line: str, status: int) -> None:
        super().__init__(line, error_code=self.CODES[status])
        self.line, self.status = line, status

    def get_http_status_code(self) -> int:
        return self.status

    def serialize_as_json(self) -> str:
        return json.dumps({"error_code": self.error_code, "message": self.line})


class SATPyfunc(mlflow.pyfunc.PythonModel):
    """``mlflow.pyfunc.load_model(uri).predict(inputs)``: one prediction per input, as ``satp predict --json``."""

    def load_context(self, context) -> None:
        files = {name: Path(path) for name, path in context.artifacts.items()}
        self.predictor = Predictor(read_model(files["weights"], files["satp_model"], "pyfunc model"))
        self.limits = Limits.from_environment()  # read once: a bad setting stops the server as it starts

    # the input's type hint gives MLflow the signature (and validates inputs); no output hint: the
    # output's type depends on the task, and an untyped ``list`` draws MLflow's inference message
    def predict(self, context, model_input: list[ModelInput], params: Optional[dict[str, Any]] = None):
        values = [v.model_dump(exclude_none=True) if isinstance(v, pydantic.BaseModel) else dict(v) for v in model_input]
        try:
            return self.predictor.predict_json(values, "model input", Budget(self.limits))
        except TooLarge as exc:
            raise RequestRefused(str(exc), 413) from None
        except PastDeadline as exc:
            raise RequestRefused(str(exc), 504) from None
        except ValueError as exc:
            raise RequestRefused(str(exc), 400) from None
