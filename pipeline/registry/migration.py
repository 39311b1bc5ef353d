"""``satp models migrate NAME``: format-1 versions (pickled modules, which satp no longer loads)
re-registered weights-only (format 2, :mod:`pipeline.registry.model_format`) as new versions; the
aliases they held move to the copies."""
from __future__ import annotations


#: the tags a migrated copy keeps from its version (metric.* too): what trained it and how it scored
MIGRATED_TAGS = ("task", "run_id", "data_manifest_hash", "git_commit", "satp.config_hash", "satp.git_commits",
                 "satp.sweep")


def migrate(name: str, tracking_uri: str | None = None, echo=print) -> list[dict]:
    """Re-register each format-1 version of ``name`` once, weights-only (a new version tagged
    ``satp.migrated_from``; the old one gets ``satp.migrated_to``), and move the aliases it held
    to the copy. Returns ``[{"from", "to", "aliases"}, ...]``."""
    from pipeline.registry.addresses import check_reachable, resolve_tracking_uri
    from pipeline.registry.record import WEIGHTS_TAG

    uri = resolve_tracking_uri(tracking_uri)
    check_reachable(uri)
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        aliases = dict(client.get_registered_model(name).aliases or {})
    except MlflowException as exc:
        raise ValueError(f"{name}: no such registered model ({str(exc).splitlines()[0]})") from None
    out = []
    for version in sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version)):
        tags = dict(version.tags or {})
        if WEIGHTS_TAG in tags:
            continue  # weights-only already
        if "satp.migrated_to" in tags:
            echo(f"models:/{name}/{version.version}: migrated already (version {tags['satp.migrated_to']})")
            continue
        held = sorted(a for a, v in aliases.items() if str(v) == str(version.version))
        row = migrate_version(client, uri, name, version, held, echo)
        if row is not None:
            out.append(row)
    if not out:
        echo(f"{name}: no format-1 version to migrate")
    return out


def _a(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _unpickled_module(local, uri: str):
    """The format-1 version's pickled module, or a one-line ``ValueError`` saying what the pickle gave
    instead (MLflow's loader calls ``.eval()`` on it)."""
    import re

    import mlflow.pytorch
    import torch

    try:
        model = mlflow.pytorch.load_model(str(local), map_location="cpu")
    except AttributeError as exc:
        found = re.match(r"'(\w+)' object has no attribute", str(exc))
        what = _a(found.group(1)) if found else f"an object without a module's methods ({exc})"
        raise ValueError(f"{uri}: its format-1 pickle holds {what}, not a torch module; nothing of it was migrated") from None
    except Exception as exc:  # whatever unpickling the author's objects raises (a missing class, a bad file)
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{uri}: its format-1 pickle does not load ({type(exc).__name__}: {first}); "
                         "nothing of it was migrated") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{uri}: its format-1 pickle holds {_a(type(model).__name__)}, not a torch module; "
                         "nothing of it was migrated")
    return model


def migrate_version(client, tracking_uri: str, name: str, version, aliases: list[str], echo) -> dict | None:
    """One version of :func:`migrate` (None when it is not a format-1 satp model)."""
    import json

    from pipeline import pyg_templates
    from pipeline.registry.model_format import FORMAT, LEGACY_META, cpu_state, weights_sha256
    from pipeline.registry.versions import download, register_weights

    uri = f"models:/{name}/{version.version}"
    tags = dict(version.tags or {})
    run_id = tags.get("run_id") or version.run_id
    local = download(uri, tracking_uri)
    if not (local / LEGACY_META).is_file():
        echo(f"{uri}: not a format-1 satp model (no {LEGACY_META}): left as it is")
        return None
    if not run_id:
        raise ValueError(f"{uri}: no run to log its weights-only copy into (no run_id)")
    echo(f"{uri}: unpickling its format-1 model to migrate it (this runs the pickle's code: "
         "migrate models of your own registry only)")
    pyg_templates.install()  # unpickling builds PyG convs: no generated module left in $TMPDIR
    state = cpu_state(_unpickled_module(local, uri))
    meta = {**json.loads((local / LEGACY_META).read_text()), "format": FORMAT, "weights_sha256": weights_sha256(state)}
    kept = {k: v for k, v in tags.items() if k in MIGRATED_TAGS or k.startswith("metric.")}
    reg = register_weights(state, meta, {**kept, "run_id": run_id, "satp.migrated_from": str(version.version)},
                           run_id=run_id, tracking_uri=tracking_uri, registered_model=name)
    client.set_model_version_tag(name, str(version.version), "satp.migrated_to", str(reg["version"]))
    for alias in aliases:
        client.set_registered_model_alias(name, alias, str(reg["version"]))
    moved = f" (moved {', '.join('@' + a for a in aliases)})" if aliases else ""
    echo(f"{uri} -> {reg['registered_uri']}{moved}")
    return {"from": int(version.version), "to": reg["version"], "aliases": aliases}
