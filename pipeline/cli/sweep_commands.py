"""``satp tune`` and ``satp compare`` (registered by :mod:`pipeline.cli`).

::

    satp tune JOB.yaml [--set dotted.key=value ...] [--address ADDR]
        the job's ASHA sweep (tune: section), MLflow parent + child runs, best model registered,
        alias champion moved only if it beats the current champion; a rerun resumes

    satp compare JOB.yaml [--set dotted.key=value ...] [--address ADDR]
        every variant of the job's compare: section x every seed, each a full training run, at
        equal budget; MLflow parent + child runs; per-variant mean ± std of the test metric at
        the best validation epoch, a table (printed, and compare.md) and a plot; a rerun resumes
"""
from __future__ import annotations

import argparse

from pipeline.cli.args import add_job_arguments, run_section_command


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="ASHA hyperparameter sweep of a job (its tune: section), logged to MLflow")
    add_job_arguments(p, "tune.num_samples=8")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("compare", help="variants of a job x seeds at equal budget (its compare: section), "
                                       "mean ± std per variant, logged to MLflow")
    add_job_arguments(p, "compare.seeds=[0,1]")
    p.set_defaults(func=cmd_compare)


def cmd_tune(args: argparse.Namespace) -> int:
    return run_section_command(args, "tune", "jobs/code2-sweep-local.yaml", "pipeline.sweep.tune:run_sweep")


def cmd_compare(args: argparse.Namespace) -> int:
    return run_section_command(args, "compare", "jobs/pattern-local.yaml", "pipeline.sweep.compare:run_compare")
