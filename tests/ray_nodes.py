"""A Ray cluster of several nodes on this machine, for tests that lose and add nodes.

Each node is a ``ray start --block`` process with its own ports, in one temporary directory (their
storage: one machine's file system is what every node sees; on a real cluster ``shards.root``,
``train.storage_path`` and the MLflow store are shared storage), or, with ``own_folders``, each in a
folder of its own, as nodes without a shared disk are: its Ray temporary folder, ``TMPDIR`` and
``HOME`` (the shard cache's default) there. A node is "lost" the hard way:
SIGKILL to its ``ray start``, raylet and agents (its process group) and to every worker its raylet
started (Ray gives each worker a process group of its own). Ray's node health check is tightened
(1 s x 3) so that a node's death is declared in seconds. The nodes' Train workers are forked from one
fork server (:mod:`runtime.fork_server`), which the nodes' and the commands' environment name, as
docs/scale.md has a cluster satp did not start do it; a lost node's forked workers die with it. Only
the processes these helpers started are ever stopped (never ``ray stop``, which would stop every Ray
cluster on the machine).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psutil

from runtime import fork_server
from runtime.local_cluster import LOOPBACK_ENV, stop_in_order
from runtime.ports import free_ports
from runtime.ray_cluster import LOCAL_TRAIN_ENV

BIN = Path(sys.executable).parent
#: ``ray start --block`` drains its node on SIGTERM (for Ray Serve) for up to 30 s before it stops it: a
#: node's stop waited for that, or for the kill 8 s later; read when Ray is imported, so every process of
#: the cluster and its commands has it (the fork server forks only for equal import-time settings)
NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
#: Train's controller polls its workers as on satp's own local clusters (a run's end, a lost worker seen sooner)
HEALTH_CHECK = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": LOCAL_TRAIN_ENV["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]}


def forked_pids(log_path: Path) -> dict[int, int]:
    """``{client pid: forked pid}`` from a fork server's log (its "forked pid P for client pid C: ..." lines)."""
    try:
        lines = log_path.read_text().splitlines()
    except OSError:
        return {}
    words = (line.split(":", 1)[0].split() for line in lines if line.startswith("forked pid "))
    return {int(w[-1]): int(w[2]) for w in words if len(w) == 7 and w[-1].isdigit()}


def _proc(pid: int) -> tuple[int, int, str]:
    """(process group, parent pid, argv[0]) of a process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    return int(fields[2]), int(fields[1]), argv0


def _all_procs() -> dict[int, tuple[int, int, str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = _proc(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


class Node:
    """One ``ray start --block`` node of the test cluster, and the processes that are the node."""

    def __init__(self, temp: str, env: dict, gcs_port: int, head: bool, cpus: int, own_folder: bool = False) -> None:
        self.temp, self.env, self.gcs_port, self.head, self.cpus = temp, env, gcs_port, head, cpus
        self.proc = None
        self.log = Path(temp) / f"{'head' if head else 'node'}-{time.time_ns()}.log"
        #: the node's own disk (Ray's temporary folder, TMPDIR, HOME), or None: the cluster's folder (a
        #: short name: Ray's socket paths below it must fit 107 bytes)
        self.folder = Path(tempfile.mkdtemp(prefix="h" if head else "n", dir=temp)) if own_folder else None
        if self.folder is not None:
            for sub in ("ray", "tmp", "home"):
                (self.folder / sub).mkdir()
            self.env = dict(env, TMPDIR=str(self.folder / "tmp"), HOME=str(self.folder / "home"))
            self.env.pop("XDG_CACHE_HOME", None)

    def start(self) -> "Node":
        p = free_ports(7)
        cmd = [str(BIN / "ray"), "start", "--block", f"--num-cpus={self.cpus}", "--node-ip-address=127.0.0.1",
               f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}", f"--dashboard-agent-listen-port={p[2]}",
               f"--dashboard-agent-grpc-port={p[3]}", f"--metrics-export-port={p[4]}", f"--runtime-env-agent-port={p[5]}",
               "--disable-usage-stats"]
        if self.head:
            cmd += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false", f"--ray-client-server-port={p[6]}",
                    "--system-config=" + json.dumps({"health_check_period_ms": 1000, "health_check_failure_threshold": 3})]
        else:
            cmd += [f"--address=127.0.0.1:{self.gcs_port}"]
        if self.head or self.folder is not None:
            cmd.append(f"--temp-dir={self.folder / 'ray' if self.folder is not None else self.temp}")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_started(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while "Ray runtime started" not in self.log.read_text():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"ray start failed: {self.log.read_text()[-2000:]}")
            time.sleep(0.3)

    def pids(self) -> list[int]:
        """The node's processes: its process group, the workers its raylet started, and those forked
        for them (a forked worker's client is the raylet's child, the worker the fork server's)."""
        procs = _all_procs()
        group = [pid for pid, (pgid, _, _) in procs.items() if pgid == self.proc.pid]
        raylets = {pid for pid in group if procs[pid][2].endswith("raylet")}
        workers = [pid for pid, (_, ppid, _) in procs.items() if ppid in raylets and pid not in group]
        forked = forked_pids(Path(self.temp) / fork_server.LOG_NAME)
        return group + workers + [forked[pid] for pid in workers if forked.get(pid) in procs]

    def running(self, prefix: str) -> bool:
        """Whether one of the node's workers runs a task or actor whose title starts with ``prefix``."""
        procs = _all_procs()
        return any(procs.get(pid, (0, 0, ""))[2].startswith(prefix) for pid in self.pids())

    def kill(self) -> None:
        """The node dies at once: SIGKILL to all of its processes."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None and not self.pids():
            return
        procs = []
        for pid in self.pids():
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
        stop_in_order(procs)  # as satp cluster stop does: `ray start`, Ray's monitor and the raylet first
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def local_cluster(env: dict, head_cpus: int, node_cpus: int = 1, own_folders: bool = False) -> Iterator[dict]:
    """A head node of ``head_cpus`` CPUs; yields ``{"address", "env", "add_node", "base", "head"}``, where
    ``add_node()`` starts one more node of ``node_cpus`` CPUs and returns it once it runs, ``base`` is
    the nodes' temporary directory and ``head`` the head :class:`Node` (``own_folders``: each node has
    its own folder in ``base``, see the module docstring). Every node is stopped at the end."""
    temp = tempfile.mkdtemp(prefix="satpn", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    fork_socket = str(Path(temp) / fork_server.SOCKET_NAME)
    env = dict(env, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", OUTDATED_IGNORE="1", DS_ACCELERATOR="cpu",
               PATH=f"{BIN}:{os.environ.get('PATH', '')}", **{fork_server.SOCKET_VAR: fork_socket}, **NO_DRAIN,
               **HEALTH_CHECK)
    env.pop("RAY_ADDRESS", None)
    for key in LOOPBACK_ENV:  # Ray refuses to start a node that joins a head with it
        env.pop(key, None)
    nodes: list[Node] = []
    # one fork server for the nodes of this machine (docs/scale.md); the commands' environment names it
    with open(Path(temp) / fork_server.LOG_NAME, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "runtime.fork_server", "--serve", fork_socket],
                                       env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def started(head: bool, gcs: int, cpus: int, attempts: int = 3) -> Node:
        for attempt in range(attempts):
            node = Node(temp, env, gcs, head=head, cpus=cpus, own_folder=own_folders).start()
            nodes.append(node)
            try:
                node.wait_started()
                return node
            except RuntimeError:  # `ray start` gives a raylet 30 s to register: a loaded machine misses it
                node.stop()
                if attempt == attempts - 1:
                    raise
                gcs = free_ports(1)[0] if head else gcs

    try:
        head = started(True, free_ports(1)[0], head_cpus)

        def add_node() -> Node:
            return started(False, head.gcs_port, node_cpus)

        yield {"address": f"127.0.0.1:{head.gcs_port}", "env": env, "add_node": add_node, "base": Path(temp), "head": head}
    finally:
        for node in reversed(nodes):
            node.stop()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)
