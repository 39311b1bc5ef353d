"""The ``satp`` command. Each area registers its own subcommands; errors print one line.

The top room of :mod:`pipeline`: nothing imports it, so the library can be used without the command
line. Building the parser imports no heavy library: ``satp --help`` and a job file's validation error
come back in well under a second; torch, Ray and MLflow load only in the command that needs them.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys


#: the modules that register each area's subcommands (``register(sub)``), imported when the parser is built
AREAS = ("data_commands", "train_commands", "sweep_commands", "registry_commands", "cluster_commands")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="satp", description="Structure-Aware Transformer pipeline")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for area in AREAS:
        importlib.import_module(f"pipeline.cli.{area}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from runtime.command import set_command_environment

    set_command_environment()
    args = build_parser().parse_args(argv)
    from pipeline import console

    console.setup(progress=not getattr(args, "no_progress", False))  # its settings too are compared by a fork server
    if argv is None:  # the process's own command (a library call of main runs in the caller's process)
        forked = _on_fork_server(args, sys.argv[1:])
        if forked is not None:
            return forked
    from runtime.interrupts import install, reset

    reset()
    install()  # SIGTERM too unwinds (Ray's own handling is put back after it starts: see there)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader has gone (`satp cluster status | head -1`): nothing to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 128 + signal.SIGPIPE  # what a shell reports for a process its pipe's reader ended
    except (ValueError, OSError) as exc:
        if os.environ.get("SATP_DEBUG"):
            raise
        print(f"satp: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        return _interrupted(exc)


def _on_fork_server(args: argparse.Namespace, argv: list[str]):
    """The exit status of ``satp train`` run by the satp cluster's fork server (:mod:`runtime.fork_server`),
    or None: this process runs the command. Not when the command names another cluster (``--address``,
    ``$RAY_ADDRESS``), nor in a process forked already."""
    if args.command != "train":
        return None
    from runtime import fork_server, local_cluster
    from runtime.command import warn

    if fork_server.forked_for() is not None:
        return None
    try:
        record = local_cluster.ClusterRecord.load()
    except ValueError:
        return None  # the command says so itself
    if record is None or not record.fork_socket or not record.alive():
        return None
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS")
    if address and not record.named_by(address.split("://")[-1]):
        return None  # another cluster's command
    try:
        local_cluster.check_private(record)  # a widened folder: one line, nothing sent
    except ValueError as exc:
        print(f"satp: error: {exc}", file=sys.stderr)
        return 2
    return fork_server.run_command(record.fork_socket, argv, warn, defaults=record.worker_env)


def _interrupted(exc: KeyboardInterrupt) -> int:
    """One line on what was kept, Ray shut down (a local cluster with it), status 130 / 143 (of the
    first signal). Signals that arrive meanwhile, or until the process has exited, are ignored
    (:func:`runtime.interrupts.ending`): Ray's shutdown and the clean-up at exit run whole."""
    from runtime.interrupts import as_interrupted, ending

    ending()  # also drops what the training's handler kept alive (see runtime.interrupts)
    interrupted = as_interrupted(exc)
    if "runtime.ray_cluster" in sys.modules:  # a connection under way in a thread ends first
        with contextlib.suppress(BaseException):  # noqa: BLE001 - its error says nothing more than the interrupt
            sys.modules["runtime.ray_cluster"].wait_for_background_connect()
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            with contextlib.suppress(Exception):  # the line still comes
                ray.shutdown()
    kept = interrupted.kept or ("finished work is kept (shards and checkpoints are written whole or not "
                                "at all): the same command continues from it")
    print(f"satp: interrupted ({interrupted.signal_name}): {kept}", file=sys.stderr, flush=True)
    return interrupted.exit_code


if __name__ == "__main__":
    sys.exit(main())
