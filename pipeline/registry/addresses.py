"""Where a registry command reads (the tracking store, the model URI), checked in seconds with the
standard library only, before ``satp predict`` / ``satp models`` spend 10-30 s importing torch and MLflow."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

#: Short network timeouts for an http(s) tracking server (MLflow's defaults retry for minutes).
HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def resolve_tracking_uri(tracking_uri: Optional[str] = None) -> str:
    """``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else ``runs/mlflow.db``; a missing SQLite store
    is an error (MLflow would create it); http(s) gets short timeouts, no retries."""
    from pipeline.config.train import default_tracking_uri

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    if uri.startswith("sqlite:"):
        path = uri.split("sqlite:///", 1)[-1] if uri.startswith("sqlite:///") else ""
        if not path or not Path(path).is_file():
            raise ValueError(f"tracking store {uri}: no such SQLite file (give --tracking-uri)")
    elif uri.startswith(("http://", "https://")):
        for key, value in HTTP_ENV.items():
            os.environ.setdefault(key, value)
    return uri


def check_reachable(uri: str) -> None:
    """Fail fast (``OSError``, one line) when an http(s) tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    timeout = float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_ENV["MLFLOW_HTTP_REQUEST_TIMEOUT"]))
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=min(timeout, 10)).close()
    except urllib.error.HTTPError:
        return  # it answered (a server without /health, or auth): let MLflow report the details
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OSError(f"tracking server {uri} unreachable ({reason})") from None


def check_model_uri(uri: str) -> None:
    """A model URI satp serves: ``models:/NAME/<version number>``, ``models:/NAME@ALIAS`` or
    ``runs:/RUN_ID/PATH``, else one line saying what to write (MLflow reads ``models:/NAME`` and
    ``models:/NAME/abc`` in terms satp never uses)."""
    if not isinstance(uri, str) or not uri.startswith(("models:/", "runs:/")):
        raise ValueError(f"{uri!r}: expected a model URI such as models:/sat-code2@champion or models:/sat-code2/3")
    if not uri.startswith("models:/"):
        return
    rest = uri[len("models:/"):]
    name, slash, version = rest.partition("/")
    if "@" in name:
        return
    fix = f"name a version or an alias: models:/{name}/<version> or models:/{name}@champion (satp models lists them)"
    if not slash:
        raise ValueError(f"{uri}: {fix}")
    if not re.fullmatch(r"[0-9]+", version):
        raise ValueError(f"{uri}: {version!r} is not a version number; {fix}")
