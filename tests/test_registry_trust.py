"""The registry's trust root is what MLflow's API cannot change, and a version whose files are gone
says which; on a real SQLite MLflow store with tiny untrained models, no Ray.

The defects:

* copying five tags from version 2 onto version 1 (MLflow's API allows it) and swapping the files made
  ``satp predict ...@champion`` serve version 2's weights, status 0, and ``satp models`` listed version 1
  as sound with its own metric. MLflow's own ``run_id`` of the version, which its API cannot change,
  still named version 1's run; nor were the metric tags compared with the model's own record. Now the
  files are checked against the version's ``run_id`` and ``source`` (whose logged model holds the
  files' digests as parameters, which MLflow writes once) and the ``metric.*`` tags against
  ``satp_model.json``: one line naming the version and what disagrees.
* a champion whose ``weights.pt`` was deleted was "not a satp model (no artifacts/satp_model.json and
  artifacts/weights.pt)", and a version whose artifact folder was gone "No such artifact: ''": now one
  line naming the missing file, or the version whose artifacts are gone and their URI.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import PATTERN_GRAPHS, new_run, register_as_before, sqlite_store, stored_files, tiny_model

#: the tags the trial copied from version 2 onto version 1
COPIED = ("satp.weights_sha256", "satp.files_sha256", "run_id", "data_manifest_hash", "git_commit")


def _register(uri: str, run_id: str, name: str, seed: int, val: float) -> int:
    from pipeline.registry.versions import log_and_register

    tiny = tiny_model("pattern", seed=seed)
    return log_and_register(tiny.model, task=tiny.task, model_config=tiny.config, vocab=None, run_id=run_id,
                            tracking_uri=uri, registered_model=name, data_manifest_hash="abc",
                            metrics={"best_val_acc": val}, extra=tiny.extra,
                            provenance={"config_hash": "cfg1", "git_commits": ["c0ffee"]})["version"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trust")
    uri, exp_id = sqlite_store(tmp)
    graphs = tmp / "graphs.json"
    graphs.write_text(json.dumps(PATTERN_GRAPHS))
    return uri, exp_id, graphs


def _two_versions(store, name: str, register) -> str:
    """Versions 1 (metric 0.5) and 2 (metric 0.75) of ``name``, each from its own run; @champion on 1."""
    from mlflow.tracking import MlflowClient

    uri, exp_id, _ = store
    assert register(uri, new_run(uri, exp_id), name, 0, 0.5) == 1
    assert register(uri, new_run(uri, exp_id), name, 1, 0.75) == 2
    MlflowClient(uri).set_registered_model_alias(name, "champion", "1")
    return uri


def _tags_and_files_of_2_onto_1(uri: str, name: str) -> None:
    """What a writer of the tracking store's tags and the artifact store can do, without the database."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    two = client.get_model_version(name, "2").tags
    for key in COPIED:
        client.set_model_version_tag(name, "1", key, two[key])
    for file in ("weights.pt", "satp_model.json"):
        shutil.copyfile(stored_files(uri, name, 2) / "artifacts" / file, stored_files(uri, name, 1) / "artifacts" / file)


def _refused(uri: str, model: str, graphs: Path, capsys) -> str:
    from pipeline.cli import main

    capsys.readouterr()
    assert main(["predict", model, str(graphs), "--tracking-uri", uri]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def _listed(uri: str, name: str, capsys) -> dict:
    from pipeline.cli import main

    capsys.readouterr()
    assert main(["models", "--tracking-uri", uri, "--json"]) == 0
    (model,) = [m for m in json.loads(capsys.readouterr().out) if m["name"] == name]
    return {v["version"]: v["record"] for v in model["versions"]}


def test_tags_and_files_copied_from_another_version_are_refused(store, capsys):
    from mlflow.tracking import MlflowClient

    uri = _two_versions(store, "copied", _register)
    graphs = store[2]
    client = MlflowClient(uri)
    one, two = client.get_model_version("copied", "1"), client.get_model_version("copied", "2")
    _tags_and_files_of_2_onto_1(uri, "copied")

    line = _refused(uri, "models:/copied@champion", graphs, capsys)
    assert line.startswith("satp: error: models:/copied@champion: not what the registry recorded for version 1 at "
                           "registration: "), line
    for clause in (f"run_id {two.run_id[:12]} (MLflow's version 1 is of run {one.run_id[:12]})",
                   f"model_id {two.source.removeprefix('models:/')} (MLflow's version 1 is of {one.source})",
                   "tag satp.weights_sha256 changed since registration (its logged model records another)",
                   "tag satp.files_sha256 changed since registration",
                   "metric.best_val_acc 0.5 (its satp_model.json records 0.75)"):
        assert clause in line, (clause, line)
    assert line.endswith("; it is not served: re-register the version from its run's checkpoint"), line
    records = _listed(uri, "copied", capsys)
    assert records[2] is None and "MLflow's version 1 is of run" in records[1], records


def test_a_version_from_before_the_logged_models_record_is_checked_by_mlflows_fields(store, capsys):
    """No ``model_id`` in its files and no parameters on its logged model: the version's ``run_id`` and
    the metric tags still disagree with what the copied files say."""
    uri = _two_versions(store, "before", register_as_before)
    from pipeline.registry.versions import load_model

    load_model("models:/before@champion", tracking_uri=uri)  # sound as registered
    _tags_and_files_of_2_onto_1(uri, "before")
    line = _refused(uri, "models:/before@champion", store[2], capsys)
    assert "for version 1 at registration: run_id " in line and "(MLflow's version 1 is of run " in line, line
    assert "metric.best_val_acc 0.5 (its satp_model.json records 0.75)" in line, line
    assert "version 1 is of run" in _listed(uri, "before", capsys)[1]


def test_a_metric_tag_rewritten_alone_is_refused(store, capsys):
    from mlflow.tracking import MlflowClient

    uri = _two_versions(store, "metric", _register)
    MlflowClient(uri).set_model_version_tag("metric", "2", "metric.best_val_acc", "0.99")
    line = _refused(uri, "models:/metric/2", store[2], capsys)
    assert line == ("satp: error: models:/metric/2: not what the registry recorded for version 2 at registration: "
                    "metric.best_val_acc 0.99 (its satp_model.json records 0.75); it is not served: re-register the "
                    "version from its run's checkpoint"), line


def test_a_missing_weights_file_or_artifact_folder_is_named(store, capsys):
    from mlflow.tracking import MlflowClient

    uri = _two_versions(store, "gone", _register)
    client = MlflowClient(uri)
    one, two = (client.get_model_version_download_uri("gone", v) for v in ("1", "2"))
    (stored_files(uri, "gone", 1) / "artifacts" / "weights.pt").unlink()
    shutil.rmtree(stored_files(uri, "gone", 2))

    assert _refused(uri, "models:/gone@champion", store[2], capsys) == (
        f"satp: error: models:/gone@champion: artifacts/weights.pt is missing from version 1's artifacts at {one}")
    assert _refused(uri, "models:/gone/2", store[2], capsys) == (
        f"satp: error: models:/gone/2: the artifacts of version 2 are gone (nothing at {two})")
    assert _listed(uri, "gone", capsys) == {
        1: f"artifacts/weights.pt is missing from version 1's artifacts at {one}",
        2: f"the artifacts of version 2 are gone (nothing at {two})"}
