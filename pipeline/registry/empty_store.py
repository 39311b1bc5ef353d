"""A new SQLite tracking store starts as a copy of an empty one: MLflow makes a store by ~60 schema
migrations (1.6-6 s of CPU), so one empty store per MLflow version is kept under ``$SATP_HOME/cache``
(its ``Default`` experiment deleted: MLflow creates it with the store's artifact root). A copy is
linked into place only where nothing appeared meanwhile; where any of this fails, MLflow makes the store."""
from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
import uuid
from pathlib import Path
from typing import Optional

PREFIX = "sqlite:///"


def database_path(tracking_uri: str) -> Optional[Path]:
    """The file of a ``sqlite:///`` tracking URI (query parameters left out); None for other stores."""
    if not tracking_uri.startswith(PREFIX):
        return None
    return Path(tracking_uri[len(PREFIX):].split("?", 1)[0])


def seed(tracking_uri: str) -> bool:
    """Make the store of ``tracking_uri`` a copy of an empty one when it is a SQLite file that does
    not exist yet in a folder that does; return whether this call made it."""
    path = database_path(tracking_uri)
    if path is None or path.exists() or not path.parent.is_dir():
        return False
    try:
        template = _template()
        if template is None:
            return False
        copy = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(template, "rb") as source, open(copy, "xb") as target:  # the umask's mode, as MLflow's
                shutil.copyfileobj(source, target)
            os.link(copy, path)  # fails where a store appeared meanwhile: that one is kept
            return True
        finally:
            copy.unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - a cache: OS, SQLite and MLflow errors alike leave the store to MLflow
        return False


def template_path() -> Path:
    import mlflow

    from runtime.local_cluster import satp_home

    return satp_home() / "cache" / f"mlflow-{mlflow.__version__}-empty.db"


def _template() -> Optional[Path]:
    """This MLflow version's empty store, made on first use; None where it cannot be made."""
    path = template_path()
    if path.exists():
        if _is_empty_store(path):
            return path
        path.unlink(missing_ok=True)  # damaged: made again below
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".mlflow-empty-", dir=path.parent) as folder:
        made = Path(folder) / path.name
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        SqlAlchemyStore(f"{PREFIX}{made}", made.parent.as_uri()).engine.dispose()
        with contextlib.closing(sqlite3.connect(made)) as db, db:
            db.execute("DELETE FROM experiments")  # the Default experiment, with the template's artifact root
        os.replace(made, path)  # whole or absent; a concurrent maker writes the same tables
    return path if _is_empty_store(path) else None


def _is_empty_store(path: Path) -> bool:
    """Whether ``path`` reads as a SQLite database with MLflow's schema version and no experiment."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            (version,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
            (experiments,) = db.execute("SELECT count(*) FROM experiments").fetchone()
        return bool(version) and experiments == 0
    except (sqlite3.Error, TypeError, ValueError):
        return False
