"""What a registered version serves, checked against what the registry recorded for it, on a real SQLite
MLflow store with tiny untrained models, no Ray (the records MLflow's API cannot change:
``tests/test_registry_trust.py``).

The defect: version 2's ``weights.pt`` and ``satp_model.json`` both replaced by version 1's pair were
served silently (``satp predict models:/NAME/2`` gave version 1's predictions, status 0) and listed as
the healthy champion: only the two files were compared with each other. Now the files are compared
with the version's registry record (its ``satp.weights_sha256``, run, task, data hash, commit,
configuration hash, and the files' own digests): one line naming the version and what differs, and
``satp models`` marks the version and the alias on it. Also: ``models:/NAME/abc`` in satp's words, and
``satp predict`` / ``satp models`` refuse a missing input before they import torch or MLflow.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (PATTERN_GRAPHS, new_run, register_as_before, register_tiny, sqlite_store, stored_files,
                           tiny_model)

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "mlflow", "ray", "torch_geometric")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Versions 1 and 2 of ``tiny`` (other weights), @champion on 2, and a JSON graph file."""
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("record")
    uri, exp_id = sqlite_store(tmp)
    run_id = new_run(uri, exp_id)
    for seed in (0, 1):
        register_tiny(tiny_model("pattern", seed=seed), uri, run_id, "tiny")
    MlflowClient(uri).set_registered_model_alias("tiny", "champion", "2")
    graphs = tmp / "graphs.json"
    graphs.write_text(json.dumps(PATTERN_GRAPHS))
    return uri, graphs


@pytest.fixture
def two_versions(store, tmp_path):
    """The module's store, version 2 as registered again after the test (its files and tags)."""
    from mlflow.tracking import MlflowClient

    uri, _ = store
    client = MlflowClient(uri)
    files = stored_files(uri, "tiny", 2) / "artifacts"
    saved, tags = tmp_path / "saved", dict(client.get_model_version("tiny", "2").tags)
    shutil.copytree(files, saved)
    yield store
    shutil.rmtree(files)
    shutil.copytree(saved, files)
    for key, value in tags.items():
        client.set_model_version_tag("tiny", "2", key, value)


def _swap(uri: str, files=("weights.pt", "satp_model.json")) -> None:
    """Version 2's files replaced by version 1's (what someone who can write the artifact store can do)."""
    one, two = (stored_files(uri, "tiny", v) / "artifacts" for v in (1, 2))
    for name in files:
        shutil.copyfile(one / name, two / name)


def test_a_version_serving_another_versions_files_is_refused_and_marked(two_versions, capsys):
    from pipeline.cli import main
    from pipeline.registry.versions import load_model

    uri, graphs = two_versions
    assert main(["predict", "models:/tiny/2", str(graphs), "--tracking-uri", uri]) == 0
    capsys.readouterr()
    _swap(uri)
    for model in ("models:/tiny/2", "models:/tiny@champion"):
        with pytest.raises(ValueError) as refused:
            load_model(model, tracking_uri=uri)
        line = str(refused.value)
        assert line.startswith(f"{model}: not what the registry recorded for version 2 at registration: "
                               "weights_sha256 "), line
        assert "\n" not in line and "not served" in line, line
        assert main(["predict", model, str(graphs), "--tracking-uri", uri]) == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert err == f"satp: error: {line}"
    assert load_model("models:/tiny/1", tracking_uri=uri).info["weights_sha256"]  # the other version serves on

    assert main(["models", "--tracking-uri", uri]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tiny  (2 versions; @champion -> v2 (NOT AS REGISTERED))"), lines
    (v1,) = [line for line in lines if line.startswith("  v1 ")]
    (v2,) = [line for line in lines if line.startswith("  v2 ")]
    assert "NOT AS REGISTERED" not in v1 and "NOT AS REGISTERED: not what the registry recorded for version 2" in v2
    assert main(["models", "--tracking-uri", uri, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)[0]["versions"]
    assert listed[0]["record"] is None and "weights_sha256" in listed[1]["record"]


def test_the_json_alone_edited_is_caught_by_the_files_digests(two_versions):
    """A change that keeps every identity field (here: a vocabulary entry, which decides predictions)."""
    from pipeline.registry.record import META_FILE
    from pipeline.registry.versions import load_model

    uri, _ = two_versions
    meta_file = stored_files(uri, "tiny", 2) / "artifacts" / META_FILE
    meta = json.loads(meta_file.read_text())
    meta["metrics"] = {"best_val_acc": 0.99}
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"^models:/tiny/2: not what the registry recorded for version 2 at "
                                         r"registration: satp_model.json sha256 [0-9a-f]{12} \(recorded [0-9a-f]{12}\)"):
        load_model("models:/tiny/2", tracking_uri=uri)


def test_a_version_registered_before_the_files_digests_is_checked_by_its_weights_tag(store):
    """Two such versions of one run, with the same metric: the weights' tag still tells their files apart."""
    from mlflow.tracking import MlflowClient

    from pipeline.registry.versions import load_model

    uri, _ = store
    run_id = new_run(uri, MlflowClient(uri).get_experiment_by_name("t").experiment_id)
    for seed in (0, 1):
        register_as_before(uri, run_id, "early", seed, 0.5, files_digests=False)
    load_model("models:/early/2", tracking_uri=uri)
    for name in ("weights.pt", "satp_model.json"):
        shutil.copyfile(stored_files(uri, "early", 1) / "artifacts" / name, stored_files(uri, "early", 2) / "artifacts" / name)
    with pytest.raises(ValueError, match=r"version 2 at registration: weights_sha256 [0-9a-f]{12} \(recorded "):
        load_model("models:/early/2", tracking_uri=uri)


def _light(argv: list[str]) -> tuple[int, str, list[str]]:
    """``satp ARGV`` in a fresh process: status, standard error, and which heavy libraries it imported."""
    code = (f"import sys; from pipeline.cli import main; rc = main({argv!r}); "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules)); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return done.returncode, done.stderr, json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_bad_inputs_are_refused_before_the_heavy_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    return 1\n")
    missing_store = f"sqlite:///{tmp_path / 'none.db'}"
    cases = [
        (["predict", "models:/tiny/1", str(tmp_path / "missing.py")], f"{tmp_path / 'missing.py'}: no such file"),
        (["predict", "models:/tiny/abc", str(source)],
         "models:/tiny/abc: 'abc' is not a version number; name a version or an alias: models:/tiny/<version> or "
         "models:/tiny@champion"),
        (["predict", "models:/tiny/1", str(source), "--tracking-uri", missing_store], "no such SQLite file"),
        (["models", "--tracking-uri", missing_store], "no such SQLite file"),
    ]
    for argv, says in cases:
        status, err, heavy = _light(argv)
        assert status == 2 and err.startswith("satp: error: ") and says in err and err.count("\n") == 1, (argv, err)
        assert heavy == [], (argv, heavy)
