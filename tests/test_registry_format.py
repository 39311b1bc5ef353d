"""The registry's weights-only model format (format 2), on a real SQLite MLflow store, no Ray.

Tiny untrained models are logged straight to the store (``tests.helpers``):

* round trip: log -> register -> load gives the in-memory model's outputs (code2, pattern), through
  satp's loader and through ``mlflow.pyfunc.load_model(...).predict``; registering warns nothing;
* loading unpickles nothing: with ``pickle``/``cloudpickle`` loading patched to fail, and malicious
  pickles planted where MLflow's pickle flavours would look, loading works and no pickle runs;
  a weights file that is a pickle, or holds other weights than recorded, is refused;
* format-1 versions (a pickled ``mlflow.pytorch`` module) are refused in one line saying what to do,
  and listed as not weights-only;
* the same weights of a run are registered once.
"""
from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import torch

from tests.helpers import (PATTERN_GRAPHS, new_run, register_format1, register_tiny, sqlite_store, stored_files,
                           tiny_model)

SOURCE = '''
def get_name(self):
    return self.name


class Box:
    def set_value(self, x):
        self.value = x + 1
'''


class Planted:
    """A pickle that creates ``marker`` when unpickled (what a malicious registry entry would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _outputs(model, graphs) -> torch.Tensor:
    from torch_geometric.data import Batch

    with torch.no_grad():
        return model(Batch.from_data_list(graphs))


@pytest.mark.parametrize("task_name", ["code2", "pattern"])
def test_round_trip_predicts_as_the_logged_model(tmp_path, caplog, task_name):
    import warnings

    import mlflow.pyfunc
    from mlflow.tracking import MlflowClient

    from pipeline.registry.predict import load
    from pipeline.registry.versions import load_model

    uri, exp_id = sqlite_store(tmp_path)
    tiny = tiny_model(task_name)
    run_id = new_run(uri, exp_id)
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg = register_tiny(tiny, uri, run_id, "tiny")
    # no warning (format 1 drew MLflow's pickle warning on every registration), nor logged one
    assert [str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning)] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert reg["registered_uri"] == "models:/tiny/1" and "reason" not in reg

    loaded = load_model(reg["registered_uri"], tracking_uri=uri)
    assert loaded.info["format"] == 2 and loaded.info["metrics"] == {"best_val_acc": 0.5}
    assert loaded.info["provenance"] == {"config_hash": "cfg1", "git_commits": ["c0ffee"]}
    assert loaded.model_config == tiny.config and loaded.vocab == tiny.vocab and loaded.task.name == task_name
    tags = MlflowClient(uri).get_model_version("tiny", "1").tags
    assert tags["satp.weights_sha256"] == loaded.info["weights_sha256"] and tags["satp.config_hash"] == "cfg1"
    assert torch.equal(_outputs(loaded.model, [tiny.sample]), _outputs(tiny.model, [tiny.sample]))

    # MLflow's pyfunc interface: JSON inputs, the same predictions as satp's Python API
    predictor = load(reg["registered_uri"], tracking_uri=uri)
    pyfunc = mlflow.pyfunc.load_model(reg["registered_uri"])
    if task_name == "code2":
        rows = pyfunc.predict([{"source": SOURCE}])
        assert [[r["name"] for r in rows[0]]] == [["get_name", "set_value"]]
        assert [r["predicted"] for r in rows[0]] == [p.predicted for p in predictor.predict(SOURCE)]
    else:
        path = tmp_path / "graphs.json"
        path.write_text(json.dumps(PATTERN_GRAPHS))
        assert pyfunc.predict(PATTERN_GRAPHS) == [p for _, p in predictor.predict_file(path)]
        assert [len(p) for p in pyfunc.predict(PATTERN_GRAPHS)] == [4, 3]


def test_loading_unpickles_nothing(tmp_path, monkeypatch):
    import cloudpickle
    import mlflow.pyfunc

    from pipeline.registry.versions import load_model

    uri, exp_id = sqlite_store(tmp_path)
    tiny = tiny_model("pattern")
    reg = register_tiny(tiny, uri, new_run(uri, exp_id), "tiny")
    marker = tmp_path / "unpickled"
    stored = stored_files(uri, "tiny", reg["version"])
    # where MLflow's pickle flavours look: a pickled PythonModel, mlflow.pytorch's pickled module
    (stored / "python_model.pkl").write_bytes(cloudpickle.dumps(Planted(marker)))
    (stored / "data").mkdir()
    (stored / "data" / "model.pth").write_bytes(pickle.dumps(Planted(marker)))

    def refuse(*args, **kwargs):
        raise AssertionError("unpickled while loading")

    torch_load, loads = torch.load, []

    def weights_only_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True
        loads.append(args[0])
        return torch_load(*args, **kwargs)

    with monkeypatch.context() as patch:
        for module in (pickle, cloudpickle):
            patch.setattr(module, "load", refuse)
            patch.setattr(module, "loads", refuse)
        patch.setattr(pickle, "Unpickler", refuse)
        patch.setattr(torch, "load", weights_only_load)
        loaded = load_model("models:/tiny/1", tracking_uri=uri)
    assert [Path(f).name for f in loads] == ["weights.pt"]
    assert torch.equal(_outputs(loaded.model, [tiny.sample]), _outputs(tiny.model, [tiny.sample]))
    mlflow.pyfunc.load_model("models:/tiny/1").predict(PATTERN_GRAPHS)  # MLflow's loader: models from code
    assert not marker.exists()


def test_weights_that_are_not_the_recorded_tensors_are_refused(tmp_path):
    from pipeline.registry.versions import load_model

    uri, exp_id = sqlite_store(tmp_path)
    run_id = new_run(uri, exp_id)
    marker = tmp_path / "unpickled"
    cases = [
        (lambda path: path.write_bytes(pickle.dumps({"w": Planted(marker)}, protocol=2)), "is not a weights-only tensor file"),
        (lambda path: torch.save({"w": Planted(marker)}, path), "is not a weights-only tensor file"),
        (lambda path: torch.save([torch.ones(2)], path), "holds list, expected a dict of named tensors"),
        (lambda path: torch.save({k: v + 1 for k, v in torch.load(path, weights_only=True).items()}, path),
         "weights.pt does not match the weights_sha256 of satp_model.json"),
    ]
    for seed, (tamper, message) in enumerate(cases):
        reg = register_tiny(tiny_model("pattern", seed=seed), uri, run_id, "tiny")
        tamper(stored_files(uri, "tiny", reg["version"]) / "artifacts" / "weights.pt")
        with pytest.raises(ValueError, match=message) as info:
            load_model(reg["registered_uri"], tracking_uri=uri)
        assert str(info.value).startswith(reg["registered_uri"]) and "\n" not in str(info.value)
    assert not marker.exists()


def test_same_weights_of_a_run_are_registered_once(tmp_path):
    from mlflow.tracking import MlflowClient

    uri, exp_id = sqlite_store(tmp_path)
    run_id = new_run(uri, exp_id)
    first = register_tiny(tiny_model("pattern"), uri, run_id, "tiny")
    again = register_tiny(tiny_model("pattern"), uri, run_id, "tiny")  # the same weights, built again
    assert first["version"] == again["version"] == 1
    assert again["registered_uri"] == "models:/tiny/1" and again["reason"].startswith("weights already registered as version 1")
    other = register_tiny(tiny_model("pattern", seed=1), uri, run_id, "tiny")
    elsewhere = register_tiny(tiny_model("pattern"), uri, new_run(uri, exp_id), "tiny")  # another run's weights: its own version
    assert (other["version"], elsewhere["version"]) == (2, 3) and "reason" not in other
    client = MlflowClient(uri)
    assert sorted(int(v.version) for v in client.search_model_versions("name='tiny'")) == [1, 2, 3]
    assert len(client.search_logged_models([exp_id])) == 3  # nothing logged for the duplicate


# ----------------------------------------------------------------------------- format 1
def test_format1_is_refused_in_one_line_and_listed(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.cli import main
    from pipeline.registry.versions import load_model

    uri, exp_id = sqlite_store(tmp_path)
    assert register_format1(tiny_model("pattern"), uri, new_run(uri, exp_id), "old") == 1
    MlflowClient(uri).set_registered_model_alias("old", "champion", "1")
    with pytest.raises(ValueError) as info:
        load_model("models:/old@champion", tracking_uri=uri)
    assert str(info.value) == ("models:/old@champion: a format-1 satp model (a pickled module, which satp does not "
                               "load); train its job again with satp train to register it weights-only")
    graphs = tmp_path / "graphs.json"
    graphs.write_text(json.dumps(PATTERN_GRAPHS))
    capsys.readouterr()  # MLflow's messages so far
    assert main(["predict", "models:/old/1", str(graphs), "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("satp:")] == [
        f"satp: error: models:/old/1: {str(info.value).split(': ', 1)[1]}"] and "Traceback" not in err
    assert main(["models", "--tracking-uri", uri]) == 0
    assert "(not weights-only: satp predict refuses it)" in capsys.readouterr().out
    assert main(["models", "--tracking-uri", uri, "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)[0]["versions"]
    assert listed["format"] == 1 and listed["record"] is None


def test_a_raw_pickle_weights_file_is_refused_in_one_clean_line(tmp_path, capsys):
    """Torch's warnings came first and the reason was cut off mid-word."""
    from pipeline.cli import main

    uri, exp_id = sqlite_store(tmp_path)
    reg = register_tiny(tiny_model("pattern"), uri, new_run(uri, exp_id), "tiny")
    marker = tmp_path / "unpickled"
    (stored_files(uri, "tiny", reg["version"]) / "artifacts" / "weights.pt").write_bytes(
        pickle.dumps({"w": Planted(marker)}, protocol=2))
    graphs = tmp_path / "graphs.json"
    graphs.write_text(json.dumps(PATTERN_GRAPHS))
    capsys.readouterr()
    assert main(["predict", "models:/tiny/1", str(graphs), "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("satp: error: models:/tiny/1: weights.pt is not a weights-only tensor file (Unsupported "
                          "global: GLOBAL ") and err.endswith(": it holds more than tensors)") and "\n" not in err, err
    assert not marker.exists()
