"""``satp models`` (registered models, versions, aliases, metrics) and ``satp predict MODEL_URI INPUT``."""
from __future__ import annotations

import argparse
import dataclasses
import json

TRACKING_HELP = "MLflow tracking URI (default $MLFLOW_TRACKING_URI or runs/mlflow.db)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="registered models: versions, aliases, metrics, data hash, commit")
    p.add_argument("--tracking-uri", default=None, help=TRACKING_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("predict", help="predict with a registered model (code2: method names of a Python file)")
    p.add_argument("model_uri", metavar="MODEL_URI", help="models:/NAME@alias or models:/NAME/VERSION")
    p.add_argument("input", metavar="INPUT",
                   help="a Python file (code2), a shard directory or a JSON graph file (ppa, pattern, cluster)")
    p.add_argument("--tracking-uri", default=None, help=TRACKING_HELP)
    p.add_argument("--split", default="test", help="split to predict when INPUT is a shard directory (default test)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_predict)


def cmd_models(args: argparse.Namespace) -> int:
    from pipeline.registry.listing import format_models, list_models

    models = list_models(args.tracking_uri)
    print(json.dumps(models, indent=1) if args.json else format_models(models))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.registry.addresses import check_model_uri, check_reachable, resolve_tracking_uri

    # what can be wrong before torch, MLflow and the model load (10-30 s on a busy machine): seconds
    if not Path(args.input).exists():
        raise ValueError(f"{args.input}: no such file")
    check_model_uri(args.model_uri)
    check_reachable(resolve_tracking_uri(args.tracking_uri))
    from pipeline.registry.predict import FunctionPrediction, format_predictions, load

    model = load(args.model_uri, tracking_uri=args.tracking_uri)
    predictions = model.predict_file(args.input, split=args.split)
    if args.json:
        print(json.dumps([dataclasses.asdict(p) if isinstance(p, FunctionPrediction) else
                          {"graph": p[0], "predicted": p[1]} for p in predictions]))
    else:
        print(f"# {args.model_uri} ({model.task_name}) on {args.input}: {len(predictions)} "
              f"{'functions' if model.task_name == 'code2' else 'graphs'}")
        print(format_predictions(predictions))
    return 0
