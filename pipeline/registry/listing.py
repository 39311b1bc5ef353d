"""``satp models``: the registered models, their versions, aliases and tags (metrics, data hash,
commit), as data (:func:`list_models`) and as a table (:func:`format_models`). A version that serves
other files than the registry recorded (:mod:`pipeline.registry.record`) is marked, and so is an alias
on it."""
from __future__ import annotations


def list_models(tracking_uri: str | None = None) -> list[dict]:
    """Registered models with their aliases and versions (tags: metrics, data hash, commit)."""
    from pipeline.registry.addresses import check_reachable, resolve_tracking_uri
    from pipeline.registry.record import WEIGHTS_TAG

    uri = resolve_tracking_uri(tracking_uri)
    check_reachable(uri)
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out = []
    try:
        models = list(client.search_registered_models(max_results=1000))
        for rm in sorted(models, key=lambda m: m.name):
            aliases = dict(rm.aliases or {})
            versions = []
            for v in sorted(client.search_model_versions(f"name='{rm.name}'"), key=lambda v: int(v.version)):
                tags = dict(v.tags or {})
                versions.append({
                    "version": int(v.version),
                    "aliases": sorted(a for a, held in aliases.items() if str(held) == str(v.version)),
                    "task": tags.get("task"),
                    "metrics": {k.removeprefix("metric."): _num(val) for k, val in sorted(tags.items()) if k.startswith("metric.")},
                    "data_manifest_hash": tags.get("data_manifest_hash"),
                    "git_commit": tags.get("git_commit"),
                    "run_id": v.run_id,
                    "created": v.creation_timestamp,
                    "replaced_reason": tags.get("satp.replaced_reason"),
                    # weights-only (format 2) versions carry their weights' sha256; others (format 1, a
                    # pickled module, or not satp's) are not served
                    "format": 2 if WEIGHTS_TAG in tags else 1,
                    # what differs from the registry's record (None: it serves what was registered)
                    "record": _record(client, rm.name, v, uri) if WEIGHTS_TAG in tags else None,
                })
            out.append({"name": rm.name, "aliases": aliases, "versions": versions})
    except MlflowException as exc:
        raise OSError(f"tracking store {uri}: {str(exc).splitlines()[0]}") from None
    return out


def _record(client, name: str, version, tracking_uri: str):
    """What ``version``'s files differ in from MLflow's and the registry's record of it, or None."""
    from pipeline.registry.record import META_FILE, logged_model, read_meta, record_problem, served_files

    uri = f"models:/{name}/{version.version}"
    try:
        files = served_files(uri, tracking_uri, version)
        return record_problem(version, read_meta(files / META_FILE, uri), files, logged_model(client, version))
    except ValueError as exc:
        return str(exc).removeprefix(f"{uri}: ")


def _num(text: str):
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def format_models(models: list[dict]) -> str:
    if not models:
        return "no registered models"
    lines = []
    for m in models:
        unsound = {str(v["version"]) for v in m["versions"] if v["record"]}
        aliases = ", ".join(f"@{a} -> v{v}" + (" (NOT AS REGISTERED)" if str(v) in unsound else "")
                            for a, v in sorted(m["aliases"].items())) or "no aliases"
        lines.append(f"{m['name']}  ({len(m['versions'])} versions; {aliases})")
        for v in m["versions"]:
            metric = ", ".join(f"{k} {val:.4f}" if isinstance(val, float) else f"{k} {val}"
                               for k, val in v["metrics"].items() if k.startswith("best_val") or k.startswith("best_test"))
            alias = " ".join(f"@{a}" for a in v["aliases"])
            data = (v["data_manifest_hash"] or "-")[:12]
            commit = (v["git_commit"] or "-")[:12] + ("-dirty" if (v["git_commit"] or "").endswith("-dirty") else "")
            note = "  (not weights-only: satp predict refuses it)" if v["format"] == 1 else ""
            if v["record"]:
                note += f"  (NOT AS REGISTERED: {v['record']}; satp predict refuses it)"
            lines.append(f"  v{v['version']:<3} {alias:<11} {v['task'] or '-':<6} {metric or '-'}  data {data}  "
                         f"commit {commit}{note}")
    return "\n".join(lines)
