"""One way to register a trained model: :func:`pipeline.registry.versions.register` and the default
name it builds (:func:`~pipeline.registry.versions.default_model_name`), which training
and sweeps (both through ``pipeline.train.mlflow_run.register_weights``) and a sweep's rerun
(``pipeline.sweep.tune``) all use. The name ``sat-<task>`` was built in three places.
On a real SQLite MLflow store with a tiny untrained model, no Ray."""
from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import new_run, sqlite_store, tiny_job_dict, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_name_is_built_in_one_place():
    building = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "pipeline").rglob("*.py")
                      if re.search(r"""f["']sat-\{""", path.read_text()))
    assert building == ["pipeline/registry/versions.py"], building


def test_register_names_and_tags_the_version(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.config import JobConfig
    from pipeline.registry.versions import default_model_name, register

    uri, exp_id = sqlite_store(tmp_path)
    values = tiny_job_dict(tmp_path)
    values["mlflow"].update(tracking_uri=uri, registered_model=None)
    unnamed = JobConfig.model_validate(values)
    values["mlflow"]["registered_model"] = "mine"
    named = JobConfig.model_validate(values)
    assert (default_model_name(unnamed, "pattern"), default_model_name(named, "pattern")) == ("sat-pattern", "mine")

    tiny = tiny_model("pattern")
    client = MlflowClient(uri)
    for job, name, constant in ((unnamed, "sat-pattern", 0.25), (named, "mine", None)):
        state = {"best": {"val": 0.5, "test": 0.375, "epoch": 3}, "constant": constant}
        reg = register(tiny.model, job=job, task=tiny.task, model_config=tiny.config, state=state,
                       run_id=new_run(uri, exp_id), data_manifest_hash="abc", extra=tiny.extra)
        assert (reg["registered_model"], reg["registered_uri"]) == (name, f"models:/{name}/1"), reg
        tags = client.get_model_version(name, "1").tags
        metrics = {k: v for k, v in tags.items() if k.startswith("metric.")}
        assert metrics == {"metric.best_val_acc": "0.5", "metric.best_test_acc": "0.375", "metric.best_epoch": "3",
                           **({"metric.constant_acc": "0.25"} if constant is not None else {})}, metrics
