"""``satp cluster start | status | stop``: the local Ray cluster that keeps worker processes warm
(:mod:`runtime.local_cluster`); every satp command on this machine uses it while it runs."""
from __future__ import annotations

import argparse
import os
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="a local Ray cluster kept warm for every satp command (start, status, stop)")
    verbs = p.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    start = verbs.add_parser("start", help="start it (loopback only) and wait until its worker processes are warm")
    start.add_argument("--num-cpus", type=int, default=None, help="CPUs it offers (default: this machine's)")
    start.add_argument("--num-gpus", type=int, default=None, help="GPUs it offers (default: this machine's)")
    start.add_argument("--workers", type=int, default=None,
                       help="Train workers kept warm for a run (default: one per GPU, else per CPU)")
    start.add_argument("--no-dashboard", action="store_true",
                       help="no dashboard (saves ~0.9 GiB; satp submit and ray job submit need it)")
    start.add_argument("--no-wait", action="store_true", help="return once Ray runs, before the workers are warm")
    start.add_argument("--warm-driver", action=argparse.BooleanOptionalAction, default=True,
                       help="also a process that imported satp's driver, from which satp train commands are forked "
                            "(default; pipeline/cli/warm_driver.py: ~10 s less to a warm run's first step on 2 cores)")
    start.set_defaults(func=cmd_start)
    status = verbs.add_parser("status", help="where it runs and its warm worker processes")
    status.set_defaults(func=cmd_status)
    stop = verbs.add_parser("stop", help="stop it: its processes and its temporary folder")
    stop.set_defaults(func=cmd_stop)


def cmd_start(args: argparse.Namespace) -> int:
    from runtime import local_cluster

    shown = {"last": None}

    def progress(ready: int, wanted: int) -> None:
        if shown["last"] != ready:
            print(f"satp cluster: {ready} of {wanted} worker processes warm", file=sys.stderr, flush=True)
            shown["last"] = ready

    started = time.monotonic()
    command_env = dict(os.environ)  # before Ray's client settles in this process: what commands have
    record = local_cluster.start(num_cpus=args.num_cpus, num_gpus=args.num_gpus, workers=args.workers,
                                 dashboard=not args.no_dashboard, wait=not args.no_wait, progress=progress)
    if args.warm_driver:
        from pipeline.cli.warm_driver import start

        start(record, command_env, wait=not args.no_wait)
    print(_describe(record))
    print(f"started in {time.monotonic() - started:.0f} s; satp commands on this machine run there until "
          f"satp cluster stop")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from runtime import local_cluster

    record = local_cluster.ClusterRecord.load()
    if record is None:
        print(f"no satp cluster (record {local_cluster.record_path()}): satp commands start their own local Ray")
        return 1
    if not record.alive():
        print(f"the satp cluster of {local_cluster.record_path()} is gone (started {time.ctime(record.started)}); "
              "satp cluster stop removes what it left, satp cluster start starts a new one")
        return 1
    print(_describe(record))
    available, busy = record.pool().census()
    for kind in sorted(set(available) | set(busy)):
        print(f"  {kind.describe():<32} warm {available.get(kind, 0):>2}  in use {busy.get(kind, 0):>2}")
    difference = record.environment_difference()
    if difference:
        print(f"not used by commands of this Python environment ({difference})")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from runtime import local_cluster

    record = local_cluster.stop()
    if record is None:
        print(f"no satp cluster (record {local_cluster.record_path()})")
        return 0
    print(f"stopped the satp cluster at {record.address}; removed {record.temp_dir}")
    return 0


def _describe(record) -> str:
    from runtime.forked_workers import SOCKET_VAR

    dashboard = f", dashboard {record.dashboard}" if record.dashboard else ""
    fork_socket = record.worker_env.get(SOCKET_VAR)
    workers = (f"Train workers forked from its fork server ({fork_socket})" if fork_socket else
               f"kept warm for {record.workers} Train worker(s)")
    return (f"satp cluster at {record.address}{dashboard}: {record.cpus:g} CPU, {record.gpus:g} GPU, {workers}; "
            f"folder {record.temp_dir}"
            + (f"; satp train forked from its warm driver ({record.driver_socket})" if record.driver_socket else ""))
