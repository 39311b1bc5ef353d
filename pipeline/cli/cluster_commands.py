"""``satp cluster start | status | stop``: the local Ray cluster, private to its user and on loopback,
whose processes are forked warm (:mod:`runtime.local_cluster`); every satp command on this machine
uses it while it runs."""
from __future__ import annotations

import argparse
import os
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="a local Ray cluster kept warm for every satp command (start, status, stop)")
    verbs = p.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    start = verbs.add_parser("start", help="start it (loopback only) and wait until its fork server is ready")
    start.add_argument("--num-cpus", type=int, default=None, help="CPUs it offers (default: this machine's)")
    start.add_argument("--num-gpus", type=int, default=None, help="GPUs it offers (default: this machine's)")
    start.add_argument("--no-dashboard", action="store_true",
                       help="no dashboard (saves ~0.9 GiB; satp submit and ray job submit need it)")
    start.add_argument("--no-wait", action="store_true", help="return once Ray runs, before the fork server is ready")
    start.add_argument("--host", metavar="ADDR",
                       help="the head's address, for a cluster other nodes join (Ray's token authentication on; "
                            "default: 127.0.0.1, this machine only)")
    start.set_defaults(func=cmd_start)
    status = verbs.add_parser("status", help="where it runs, and what its fork server forked")
    status.set_defaults(func=cmd_status)
    stop = verbs.add_parser("stop", help="stop it: its processes and its folder")
    stop.set_defaults(func=cmd_stop)


def cmd_start(args: argparse.Namespace) -> int:
    from runtime import local_cluster

    started = time.monotonic()
    if not args.no_wait:
        print("satp cluster: starting Ray and the fork server (it imports torch, PyG, DeepSpeed and MLflow once)",
              file=sys.stderr, flush=True)
    record = local_cluster.start(num_cpus=args.num_cpus, num_gpus=args.num_gpus, dashboard=not args.no_dashboard,
                                 wait=not args.no_wait, host=args.host or local_cluster.LOOPBACK)
    print(_describe(record))
    if args.host:
        token = "$RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else local_cluster.private_token(dict(os.environ))
        print(f"other nodes join it with: RAY_AUTH_MODE=token ray start --address={record.address}, this cluster's "
              f"token ({token}) there as ~/.ray/auth_token (mode 600) or in $RAY_AUTH_TOKEN")
    print(f"started in {time.monotonic() - started:.0f} s; satp commands on this machine run there until "
          f"satp cluster stop")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from runtime import fork_server, local_cluster

    record = local_cluster.ClusterRecord.load()
    if record is None:
        print(f"no satp cluster (record {local_cluster.record_path()}): satp commands start their own local Ray")
        return 1
    if not record.alive():
        print(f"the satp cluster of {local_cluster.record_path()} is gone (started {time.ctime(record.started)}); "
              "satp cluster stop removes what it left, satp cluster start starts a new one")
        return 1
    local_cluster.check_private(record)
    print(_describe(record))
    if record.fork_socket:
        lines = (Path(record.folder) / fork_server.LOG_NAME).read_text().splitlines()
        print(f"  fork server: {sum(line.startswith('forked') for line in lines)} processes forked, "
              f"{sum(line.startswith('refused') for line in lines)} refused")
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
    print(f"stopped the satp cluster at {record.address}; removed {record.folder}")
    return 0


def _describe(record) -> str:
    dashboard = f", dashboard {record.dashboard}" if record.dashboard else ""
    forked = (f"its processes and satp train commands forked from its fork server ({record.fork_socket})"
              if record.fork_socket else "no fork server (GPUs)")
    return (f"satp cluster at {record.address}{dashboard}: {record.cpus:g} CPU, {record.gpus:g} GPU, {forked}; "
            f"folder {record.folder}")
