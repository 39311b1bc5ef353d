"""A new SQLite tracking store starts as a copy of an empty one (pipeline/registry/empty_store.py):
MLflow opens the copy as a store it made itself; an existing store, or one another command makes
meanwhile, is never touched; a damaged template is made again; a full disk leaves nothing behind."""
from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from pipeline.registry import empty_store, tracking


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SATP_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root (./mlruns) is the same for every store here
    return tmp_path / "home"


def _schema(path: Path) -> tuple[list, dict, str]:
    """A store's tables and indexes, each table's columns, and its schema version (MLflow's own
    migrations write a table's constraints in no fixed order: not compared as text)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        objects = sorted(db.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
        columns = {name: db.execute(f"PRAGMA table_info('{name}')").fetchall() for kind, name in objects if kind == "table"}
        (version,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
    return objects, columns, version


def _uri(path: Path) -> str:
    return f"sqlite:///{path}"


def test_a_new_store_is_a_copy_that_mlflow_opens_as_its_own(home, tmp_path):
    from mlflow.tracking import MlflowClient

    own = MlflowClient(_uri(tmp_path / "own.db"))  # made by MLflow's migrations
    (own_default,) = own.search_experiments()
    assert empty_store.seed(_uri(tmp_path / "first.db"))  # the template made, then copied
    assert empty_store.template_path().parent == home / "cache"
    assert empty_store.seed(_uri(tmp_path / "second.db"))  # a copy of the template
    for name in ("first.db", "second.db"):
        assert _schema(tmp_path / name) == _schema(tmp_path / "own.db")
        client = tracking.client(_uri(tmp_path / name))
        (default,) = client.search_experiments()  # made by MLflow on opening, for this store
        assert (default.experiment_id, default.name, default.artifact_location) == (
            own_default.experiment_id, own_default.name, own_default.artifact_location)
        experiment = tracking.ensure_experiment(client, "tiny", _uri(tmp_path / name))
        run = client.create_run(experiment)
        client.log_metric(run.info.run_id, "val_acc", 0.5, step=0)
        client.create_registered_model("sat-tiny")
        assert [m.value for m in client.get_metric_history(run.info.run_id, "val_acc")] == [0.5]
        assert [m.name for m in client.search_registered_models()] == ["sat-tiny"]


def test_an_existing_store_or_one_made_meanwhile_is_never_touched(home, tmp_path, monkeypatch):
    existing = tmp_path / "existing.db"
    existing.write_bytes(b"someone's store")
    assert not empty_store.seed(_uri(existing))
    assert existing.read_bytes() == b"someone's store"
    assert not empty_store.seed(_uri(tmp_path / "no-such-folder" / "m.db"))  # MLflow names the folder
    assert not (tmp_path / "no-such-folder").exists()

    raced = tmp_path / "raced.db"
    link = empty_store.os.link

    def another_command_first(source, target):
        Path(target).write_bytes(b"the other command's store")
        link(source, target)

    monkeypatch.setattr(empty_store.os, "link", another_command_first)
    assert not empty_store.seed(_uri(raced))
    assert raced.read_bytes() == b"the other command's store"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no copy left


def test_a_damaged_template_is_made_again(home, tmp_path):
    assert empty_store.seed(_uri(tmp_path / "first.db"))
    template = empty_store.template_path()
    template.write_bytes(template.read_bytes()[:4096])  # cut short
    assert empty_store.seed(_uri(tmp_path / "second.db"))
    assert _schema(tmp_path / "second.db") == _schema(tmp_path / "first.db") == _schema(template)


def test_a_full_disk_leaves_nothing_and_mlflow_makes_the_store(home, tmp_path, small_disk, monkeypatch):  # noqa: F811
    disk = small_disk.mount("256k")  # less than an empty store
    assert empty_store.seed(_uri(tmp_path / "elsewhere.db"))  # the template, on another disk
    assert not empty_store.seed(_uri(disk / "mlflow.db"))
    assert list(disk.iterdir()) == []
    # the template's own folder full: no template, and MLflow makes the store as it always did
    monkeypatch.setenv("SATP_HOME", str(disk))
    assert not empty_store.seed(_uri(tmp_path / "beside.db"))
    assert not (tmp_path / "beside.db").exists() and not empty_store.template_path().exists()
    client = tracking.client(_uri(tmp_path / "beside.db"))
    assert [e.name for e in client.search_experiments()] == ["Default"]
