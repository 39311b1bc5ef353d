"""``satp tune JOB.yaml`` (the job's ASHA sweep, its best model registered) and ``satp compare
JOB.yaml`` (every variant x seed at equal budget)."""
from __future__ import annotations

import argparse

from pipeline.cli.args import add_job_arguments, log_to_stderr

RESTART_HELP = ("start the {what} over (deletes its folder: Tune's state and its trials' Train runs; MLflow runs "
                "and registered versions stay) when it ran another job; without it such a rerun stops before Ray starts")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="ASHA hyperparameter sweep of a job (its tune: section), logged to MLflow")
    add_job_arguments(p, "tune.num_samples=8")
    p.add_argument("--restart", action="store_true", help=RESTART_HELP.format(what="sweep"))
    p.set_defaults(func=run_section_command, section="tune", example="jobs/code2-sweep-local.yaml",
                   run="pipeline.sweep.tune:run_sweep")

    p = sub.add_parser("compare", help="variants of a job x seeds at equal budget (its compare: section), "
                                       "mean ± std per variant, logged to MLflow")
    add_job_arguments(p, "compare.seeds=[0,1]")
    p.add_argument("--restart", action="store_true", help=RESTART_HELP.format(what="comparison"))
    p.set_defaults(func=run_section_command, section="compare", example="jobs/pattern-local.yaml",
                   run="pipeline.sweep.compare:run_compare")


def run_section_command(args: argparse.Namespace) -> int:
    """``satp tune`` / ``satp compare`` of a job with a ``section:``: ``run`` (``module:function``)
    returns an outcome, printed by that module's ``format_outcome`` after Ray has shut down, as the
    command's last output; a Tune stopped on Ctrl-C ends with status 130."""
    import importlib
    import signal
    from pathlib import Path

    from pipeline.config import load_job
    from pipeline.config.names import check_names
    from pipeline.cli.submit import enter_workdir

    job_path = Path(args.job).resolve()
    enter_workdir()
    job, section = load_job(job_path, args.overrides), args.section
    if getattr(job, section) is None:
        raise ValueError(f"{job_path}: no {section}: section (see {args.example})")
    check_names(job)  # before the heavy imports: seconds
    log_to_stderr()
    module_name, function = args.run.split(":")
    module = importlib.import_module(module_name)
    outcome = getattr(module, function)(job, address=args.address, restart=args.restart)
    shut_ray_down()
    print(module.format_outcome(outcome), flush=True)
    if outcome.interrupted:  # Tune stopped on Ctrl-C: the CLI's last line says so, after the summary (pipeline.cli)
        from pipeline.sweep.runner import WHAT
        from runtime.interrupts import Interrupted

        raise Interrupted(signal.SIGINT, kept=f"{WHAT[section]} {outcome.name} kept its finished trials and the unfinished "
                                           f"ones' checkpoints in {outcome.path}: the same command resumes it")
    return 0


#: how long the cluster's log monitor takes to forward what a process printed (as Ray's exit handler waits)
LOG_FORWARD_S = 0.5


def shut_ray_down() -> None:
    """Disconnect from Ray (a local cluster started here stops with it) once the lines its processes
    printed last have reached this one, so that nothing of Ray's comes after the summary."""
    import sys
    import time

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    time.sleep(LOG_FORWARD_S)
    ray.shutdown()
