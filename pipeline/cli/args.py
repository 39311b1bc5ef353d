"""Arguments shared by the job commands, in a module that imports nothing heavy.

``satp --help`` builds every subcommand's parser: the modules that register them import only
this (and argparse), never pydantic, torch, torch_geometric, Ray or MLflow, so that the help and
a job file's validation errors come back in well under a second.
"""
from __future__ import annotations


def add_job_arguments(parser, example: str) -> None:
    """The arguments every job command takes: the job YAML, ``--set`` overrides, ``--address``,
    ``--no-progress`` (read by :func:`pipeline.console.setup`)."""
    parser.add_argument("job", help="job YAML (jobs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a job key, e.g. --set {example} (repeatable)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address, e.g. 10.0.0.5:6379 (default $RAY_ADDRESS, else a new local Ray)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. in logs)")


def run_section_command(args, section: str, example: str, run: str) -> int:
    """``satp tune`` / ``satp compare``: the job of ``args`` must have a ``section:`` (see
    ``example``); run from the project directory (relative paths in jobs), as ``satp train`` does,
    with INFO logging on stderr. ``run`` (``module:function``) runs it and returns an outcome with
    ``interrupted``; ``format_outcome`` of the same module prints it. Interrupted (Tune stops on
    Ctrl-C and returns): :class:`runtime.interrupts.Interrupted`, which the CLI ends with its one
    last line and status 130."""
    import importlib
    import logging
    import signal
    import sys
    from pathlib import Path

    from pipeline.config import load_job
    from pipeline.config.names import check_names
    from pipeline.cli.submit import enter_workdir

    job_path = Path(args.job).resolve()
    enter_workdir()
    job = load_job(job_path, args.overrides)
    if getattr(job, section) is None:
        raise ValueError(f"{job_path}: no {section}: section (see {example})")
    check_names(job)  # before the heavy imports: seconds
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    module_name, function = run.split(":")
    module = importlib.import_module(module_name)
    outcome = getattr(module, function)(job, address=args.address)
    print(module.format_outcome(outcome), flush=True)
    if outcome.interrupted:  # Tune stopped on Ctrl-C: the CLI's last line says so, after Ray's (pipeline.cli)
        from runtime.interrupts import Interrupted

        what = {"tune": "sweep", "compare": "comparison"}[section]
        raise Interrupted(signal.SIGINT, kept=f"{what} {outcome.name} kept its finished trials and the unfinished "
                                           f"ones' checkpoints in {outcome.path}: the same command resumes it")
    return 0
