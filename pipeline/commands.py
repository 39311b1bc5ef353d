"""``satp train``, ``satp submit`` and ``satp demo`` (registered by :mod:`pipeline.cli`)."""
from __future__ import annotations

import argparse
import logging
import sys

from pipeline.cli_args import add_job_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a job on Ray Train + DeepSpeed and register the model")
    add_job_arguments(p, "train.lr=3e-4")
    p.add_argument("--no-register", action="store_true", help="do not log/register the model in MLflow")
    p.add_argument("--restart", action="store_true",
                   help="start the run name over (deletes its checkpoints) when it holds a checkpoint, e.g. of "
                        "another configuration; without it such a run stops before training")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("submit", help="submit a job YAML to a Ray cluster (Ray job submission), stream its logs")
    p.add_argument("job", help="job YAML inside the working directory")
    p.add_argument("--address", default=None, help="job server URL (default $RAY_ADDRESS or http://127.0.0.1:8265)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-wait", action="store_true", help="return once submitted")
    p.add_argument("--working-dir", default=".", help="directory uploaded as the job's working dir (default .)")
    p.add_argument("--restart", action="store_true", help="passed to satp train in the job (see satp train --help)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("demo", help="the main job end to end, locally on CPU (offline Python-source dataset)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_demo)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)


def summary(outcome) -> str:
    m = outcome.metric
    best = outcome.best
    lines = []
    if not outcome.trained:
        lines.append(f"run {outcome.run_name} had finished with this configuration (epoch {outcome.history[-1]['epoch']}"
                     f" of its checkpoint {outcome.checkpoint_path}): nothing trained, nothing registered again; "
                     "to train it again pass --restart, or raise train.epochs to continue it")
    lines.append(f"run {outcome.run_name}: best epoch {best['epoch']} val {m} {best['val']:.4f}, test {m} {best['test']:.4f}")
    if outcome.constant is not None:
        lines.append(f"test {m} {best['test']:.4f} vs best constant predictor {outcome.constant:.4f}")
    reg = outcome.registered
    if reg and reg.get("registered_uri"):
        what = "registered model" if outcome.trained else "its model"
        lines.append(f"{what}: {reg['registered_uri']} (tracking {outcome.tracking_uri})")
    return "\n".join(lines)


def cmd_train(args: argparse.Namespace) -> int:
    from pipeline.submit import enter_workdir
    from pipeline.config import load_job

    from pathlib import Path

    job_path = Path(args.job).resolve()
    enter_workdir()
    job = load_job(job_path, args.overrides)
    from pipeline.preflight import early_checks

    # the pre-flight's first steps before the heavy imports (the job alone, the data root, the
    # --address, this machine for a local cluster): seconds; train_job runs the whole pre-flight
    early_checks([job], address=args.address, task=False)
    _logging()
    from pipeline.train import train_job

    outcome = train_job(job, address=args.address, register=not args.no_register, restart=args.restart)
    print(summary(outcome), flush=True)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from pipeline.submit import submit

    return submit(args.job, address=args.address, overrides=args.overrides, wait=not args.no_wait,
                  working_dir=args.working_dir, restart=args.restart)


def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.demo import run_demo

    _logging()
    return run_demo(args.overrides)
