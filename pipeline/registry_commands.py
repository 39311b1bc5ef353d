"""``satp tune``, ``satp models`` and ``satp predict`` (registered by :mod:`pipeline.cli`).

::

    satp tune JOB.yaml [--set dotted.key=value ...] [--address ADDR]
        the job's ASHA sweep (tune: section), MLflow parent + child runs, best model registered,
        alias champion moved only if it beats the current champion; a rerun resumes
    satp models [--tracking-uri URI] [--json]
        registered models, versions, aliases, each version's metric, data hash and commit
    satp models migrate NAME [--tracking-uri URI]
        re-register NAME's format-1 versions (pickled modules, which satp no longer loads)
        weights-only, as new versions; their aliases move to the copies
    satp predict MODEL_URI INPUT [--tracking-uri URI] [--split test] [--json]
        models:/NAME@alias or models:/NAME/VERSION; INPUT: a Python file (code2), a shard
        directory or a JSON graph file (ppa; pattern and cluster: one class per node)
"""
from __future__ import annotations

import argparse
import json

from pipeline.cli_args import add_job_arguments, run_section_command


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="ASHA hyperparameter sweep of a job (its tune: section), logged to MLflow")
    add_job_arguments(p, "tune.num_samples=8")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("models", help="registered models: versions, aliases, metrics, data hash, commit")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default $MLFLOW_TRACKING_URI or runs/mlflow.db)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)
    actions = p.add_subparsers(dest="models_command", metavar="{migrate}")
    m = actions.add_parser("migrate", help="re-register a model's format-1 (pickled) versions weights-only")
    m.add_argument("name", metavar="NAME", help="the registered model")
    # SUPPRESS: `satp models --tracking-uri URI migrate NAME` keeps the URI given before the action
    m.add_argument("--tracking-uri", default=argparse.SUPPRESS, help="MLflow tracking URI (as for satp models)")
    m.set_defaults(func=cmd_migrate)

    p = sub.add_parser("predict", help="predict with a registered model (code2: method names of a Python file)")
    p.add_argument("model_uri", metavar="MODEL_URI", help="models:/NAME@alias or models:/NAME/VERSION")
    p.add_argument("input", metavar="INPUT", help="a Python file (code2), a shard directory or a JSON graph file (ppa, pattern, cluster)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default $MLFLOW_TRACKING_URI or runs/mlflow.db)")
    p.add_argument("--split", default="test", help="split to predict when INPUT is a shard directory (default test)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_predict)


def cmd_tune(args: argparse.Namespace) -> int:
    return run_section_command(args, "tune", "jobs/code2-sweep-local.yaml", "pipeline.tune:run_sweep")


# ----------------------------------------------------------------------------- satp models
def list_models(tracking_uri: str | None = None) -> list[dict]:
    """Registered models with their aliases and versions (tags: metrics, data hash, commit)."""
    from pipeline.predict import check_reachable, resolve_tracking_uri

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
            by_version: dict[str, list[str]] = {}
            for alias, version in aliases.items():
                by_version.setdefault(str(version), []).append(alias)
            versions = []
            for v in sorted(client.search_model_versions(f"name='{rm.name}'"), key=lambda v: int(v.version)):
                tags = dict(v.tags or {})
                versions.append({
                    "version": int(v.version),
                    "aliases": sorted(by_version.get(str(v.version), [])),
                    "task": tags.get("task"),
                    "metrics": {k.removeprefix("metric."): _num(val) for k, val in sorted(tags.items()) if k.startswith("metric.")},
                    "data_manifest_hash": tags.get("data_manifest_hash"),
                    "git_commit": tags.get("git_commit"),
                    "run_id": v.run_id,
                    "created": v.creation_timestamp,
                    "replaced_reason": tags.get("satp.replaced_reason"),
                })
            out.append({"name": rm.name, "aliases": aliases, "versions": versions})
    except MlflowException as exc:
        raise OSError(f"tracking store {uri}: {str(exc).splitlines()[0]}") from None
    return out


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
        aliases = ", ".join(f"@{a} -> v{v}" for a, v in sorted(m["aliases"].items())) or "no aliases"
        lines.append(f"{m['name']}  ({len(m['versions'])} versions; {aliases})")
        for v in m["versions"]:
            metric = ", ".join(f"{k} {val:.4f}" if isinstance(val, float) else f"{k} {val}"
                               for k, val in v["metrics"].items() if k.startswith("best_val") or k.startswith("best_test"))
            alias = " ".join(f"@{a}" for a in v["aliases"])
            data = (v["data_manifest_hash"] or "-")[:12]
            commit = (v["git_commit"] or "-")[:12] + ("-dirty" if (v["git_commit"] or "").endswith("-dirty") else "")
            lines.append(f"  v{v['version']:<3} {alias:<11} {v['task'] or '-':<6} {metric or '-'}  data {data}  commit {commit}")
    return "\n".join(lines)


def cmd_models(args: argparse.Namespace) -> int:
    models = list_models(args.tracking_uri)
    print(json.dumps(models, indent=1) if args.json else format_models(models))
    return 0


# ----------------------------------------------------------------------------- satp models migrate
#: the tags a migrated copy keeps from its version (metric.* too): what trained it and how it scored
MIGRATED_TAGS = ("task", "run_id", "data_manifest_hash", "git_commit", "satp.config_hash", "satp.git_commits",
                 "satp.sweep")


def migrate(name: str, tracking_uri: str | None = None, echo=print) -> list[dict]:
    """Re-register each format-1 version of ``name`` once, weights-only (a new version tagged
    ``satp.migrated_from``; the old one gets ``satp.migrated_to``), and move the aliases it held
    to the copy. Returns ``[{"from", "to", "aliases"}, ...]``."""
    from pipeline.predict import check_reachable, resolve_tracking_uri
    from pipeline.registry import WEIGHTS_TAG

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


def migrate_version(client, tracking_uri: str, name: str, version, aliases: list[str], echo) -> dict | None:
    """One version of :func:`migrate` (None when it is not a format-1 satp model)."""
    import json

    import mlflow.pytorch

    from pipeline import pyg_templates
    from pipeline.model_format import FORMAT, LEGACY_META, cpu_state, weights_sha256
    from pipeline.registry import download, register_weights

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
    state = cpu_state(mlflow.pytorch.load_model(str(local), map_location="cpu"))
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


def cmd_migrate(args: argparse.Namespace) -> int:
    migrate(args.name, args.tracking_uri)
    return 0


# ----------------------------------------------------------------------------- satp predict
def cmd_predict(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.predict import FunctionPrediction, format_predictions, load

    if not Path(args.input).exists():
        raise ValueError(f"{args.input}: no such file")
    model = load(args.model_uri, tracking_uri=args.tracking_uri)
    predictions = model.predict_file(args.input, split=args.split)
    if args.json:
        rows = [
            {"name": p.name, "line": p.line, "actual": p.actual, "predicted": p.predicted}
            if isinstance(p, FunctionPrediction) else {"graph": p[0], "predicted": p[1]}
            for p in predictions
        ]
        print(json.dumps(rows))
    else:
        print(f"# {args.model_uri} ({model.task_name}) on {args.input}: {len(predictions)} "
              f"{'functions' if model.task_name == 'code2' else 'graphs'}")
        print(format_predictions(predictions))
    return 0
