"""``satp cluster``: one local Ray cluster that outlives commands and keeps worker processes warm.

A satp command without ``--address`` used to start a Ray cluster of its own and stop it at the end:
~10 s of Ray's processes starting, then ~20 s of new worker processes importing torch, PyG and
DeepSpeed, every time. ``satp cluster start`` starts a head node once (``ray start --head``, its
dashboard and addresses on 127.0.0.1, token authentication as Ray sets it), with every worker
process importing the training modules when it starts (:mod:`runtime.worker_pool`), and leaves a
keeper process beside it that prestarts idle worker processes of the kinds a run takes. Every satp
command on this machine then finds it (:func:`for_command`) and runs there; ``--address`` still
names any other cluster.

The cluster is described by a record, ``$SATP_HOME/cluster.json`` (default ``~/.satp``): addresses,
its private temporary folder (Ray's sessions and sockets, and ``TMPDIR`` of its processes), the
processes to stop, and the Python environment it runs (:func:`environment`). A command uses the
cluster only when it runs the same Python environment: the interpreter and the versions of the
packages its warm processes imported. satp's own modules are not imported ahead (an edited checkout
is what the next run imports). A record whose cluster is gone (stopped by hand, killed, the machine
restarted) is cleaned up by the next command, which says so in one line and starts its own.
``satp cluster stop`` stops exactly this cluster's processes (never ``ray stop``, which stops every
Ray cluster on the machine) and removes its folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from runtime import forked_workers, interrupts, worker_pool
from runtime.ports import free_ports

#: packages whose versions are part of the environment a warm process runs (what it imported ahead)
ENVIRONMENT_PACKAGES = ("torch", "torch_geometric", "deepspeed", "ray", "mlflow", "numpy", "pyarrow")
START_TIMEOUT_S = 120.0


def satp_home() -> Path:
    return Path(os.environ.get("SATP_HOME") or Path.home() / ".satp").expanduser()


def record_path() -> Path:
    return satp_home() / "cluster.json"


def environment() -> dict[str, str]:
    """The Python environment of this process: interpreter and package versions."""
    from importlib import metadata

    found = {"python": os.path.realpath(sys.executable)}
    for name in ENVIRONMENT_PACKAGES:
        try:
            found[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


@dataclasses.dataclass
class ClusterRecord:
    """What ``satp cluster start`` wrote: how to reach the cluster, and how to stop it."""

    address: str  # the GCS, host:port
    dashboard: Optional[str]  # http://127.0.0.1:port, or None
    temp_dir: str
    raylet_address: str  # host:node manager port (the worker pool's RPCs)
    raylet_pid: int
    keeper_pid: Optional[int]
    cpus: float
    gpus: float
    workers: int  # Train workers the pool is kept warm for (a run's default)
    worker_env: dict[str, str]  # what the cluster's workers have in their environment
    environment: dict[str, str]
    auth_mode: str  # Ray's RAY_AUTH_MODE of the cluster
    started: float
    owner_pid: Optional[int] = None  # the process the cluster lives for (a test session), if not for good
    driver_socket: Optional[str] = None  # its warm driver's socket (pipeline.cli.warm_driver), if it runs one

    def save(self, path: Optional[Path] = None) -> None:
        path = path or record_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Optional[Path] = None) -> Optional["ClusterRecord"]:
        path = path or record_path()
        try:
            raw = json.loads(path.read_text())
            return cls(**raw)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: not a satp cluster record ({exc}); remove it (satp cluster stop)") from None

    def alive(self) -> bool:
        """The head's raylet runs and its GCS accepts connections (and its owner, if it has one, runs)."""
        import psutil

        if self.owner_pid is not None and not psutil.pid_exists(self.owner_pid):
            return False
        try:
            if psutil.Process(self.raylet_pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        host, port = self.address.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return True
        except OSError:
            return False

    def named_by(self, address: str) -> bool:
        """Whether ``address`` (``host:port``) names this cluster's GCS: its port, on an address of
        this machine (Ray itself may name the head by the machine's network address, not 127.0.0.1)."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")  # an IPv6 address in brackets
        if port != self.address.rpartition(":")[2] or not host:
            return False
        try:  # binding succeeds only on this machine's own addresses
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, 0))
        except (OSError, UnicodeError):
            return False
        return True

    def environment_difference(self) -> Optional[str]:
        """None when this process runs the cluster's Python environment, else what differs."""
        mine = environment()
        diffs = [f"{k} {self.environment.get(k)} (this command: {v})" for k, v in mine.items()
                 if self.environment.get(k) != v]
        return "; ".join(diffs) or None

    def connect_env(self) -> dict[str, str]:
        """What a client process needs in its environment to connect (Ray reads it at ray.init)."""
        return {"RAY_AUTH_MODE": self.auth_mode} if self.auth_mode == "token" else {}

    def pool(self) -> worker_pool.WorkerPool:
        """The cluster's worker pool, for this process (which then speaks the cluster's authentication)."""
        os.environ.update(self.connect_env())
        return worker_pool.WorkerPool(self.raylet_address, self.raylet_pid, self.address)


def cluster_env(use_gpu: bool, api_server: str, fork_socket: Optional[str] = None) -> dict[str, str]:
    """The environment of a satp cluster's processes (inherited by every worker the raylet starts):
    its workers import :data:`runtime.worker_pool.PRELOAD_MODULES` (PyG, DeepSpeed and the other training
    modules only the processes that run training: :func:`runtime.worker_pool.training_env`);
    ``RAY_prestart_worker_first_driver`` off (the pool decides what to prestart). No variable that
    runtime environments set (Ray Train's and Tune's): a worker's kind is what its environment adds
    to this one (:mod:`runtime.worker_pool`).

    ``api_server``: the dashboard whose State API Ray Train's placement-group cleaner asks (in a Ray
    Train run other than satp's, which start none; it
    otherwise resolves "the" cluster of the machine, and with several clusters on one machine may
    ask another one whether our controller is alive, get "no", and remove our placement group);
    without a dashboard an unreachable address, where its queries fail and it only warns.

    ``fork_socket``: the cluster's worker fork server (:mod:`runtime.forked_workers`), named to every
    process of the cluster, whose Train workers it then forks (:func:`runtime.ray_cluster.forked`)."""
    return {
        "OUTDATED_IGNORE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "DS_ACCELERATOR": "cuda" if use_gpu else "cpu",
        "RAY_prestart_worker_first_driver": "0",
        # Ray's log monitor looks for new log files every 0.5 s, not every 0.1 s (it does so below this
        # many files): ~3% of a core on a cluster of hundreds of worker logs; a new worker's first lines
        # reach the driver <= 0.5 s later
        "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
        "RAY_API_SERVER_ADDRESS": api_server,
        **worker_pool.preload_setting(worker_pool.PRELOAD_MODULES),
        **({forked_workers.SOCKET_VAR: fork_socket} if fork_socket else {}),
    }


def start(num_cpus: Optional[int] = None, num_gpus: Optional[int] = None, workers: Optional[int] = None,
          dashboard: bool = True, wait: bool = True, progress=None, owner_pid: Optional[int] = None) -> ClusterRecord:
    """Start the satp cluster (see the module docstring); raise a one-line ``ValueError`` when one
    runs already. ``wait``: return once the default pool's processes are warm. ``owner_pid``: the
    cluster counts as gone once that process has ended (the next command stops what it left)."""
    existing = ClusterRecord.load()
    if existing is not None and existing.alive():
        raise ValueError(f"a satp cluster runs already at {existing.address} (record {record_path()}); "
                         "satp cluster stop stops it")
    if existing is not None:
        stop(existing)
    cpus = int(num_cpus if num_cpus is not None else os.cpu_count() or 1)
    gpus = int(num_gpus if num_gpus is not None else _gpus_on_this_machine())
    workers = int(workers or (gpus or cpus))
    temp = tempfile.mkdtemp(prefix="satpc-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    (Path(temp) / "tmp").mkdir()
    gcs, dash, client, agent_http, agent_grpc, metrics, rt_env, nm, om = free_ports(9)
    # a CPU-only cluster forks its Train workers (a process that initialised CUDA cannot fork one that uses it)
    fork_socket = None if gpus else str(Path(temp) / forked_workers.SOCKET_NAME)
    worker_env = cluster_env(use_gpu=gpus > 0, api_server=f"http://127.0.0.1:{dash if dashboard else 9}",
                             fork_socket=fork_socket)
    env = dict(os.environ, **worker_env, TMPDIR=str(Path(temp) / "tmp"))
    for key in ("RAY_ADDRESS", *worker_pool.RUNTIME_ENV_VARS):
        env.pop(key, None)
    auth_mode = env.get("RAY_AUTH_MODE") or "token"
    env["RAY_AUTH_MODE"] = auth_mode
    if auth_mode == "token":
        private_token(env)
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           f"--num-cpus={cpus}", f"--num-gpus={gpus}", f"--temp-dir={temp}", "--disable-usage-stats",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={rt_env}", f"--node-manager-port={nm}", f"--object-manager-port={om}"]
    cmd += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"] if dashboard else ["--include-dashboard=false"]
    try:
        record = _start_recorded(cmd, env, temp, gcs, dash if dashboard else None, nm, cpus, gpus, workers, worker_env,
                                 auth_mode, owner_pid)
    except BaseException:  # failed, or interrupted (Ctrl-C, a timeout) before its record: nothing left running
        with interrupts.deferred():  # a second Ctrl-C does not cut the clean-up short
            stop_processes(temp)
            shutil.rmtree(temp, ignore_errors=True)
        raise
    if wait:
        wait_warm(record, progress=progress)
    return record


def private_token(env: dict) -> Path:
    """The token Ray's token authentication reads (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``),
    made on first use as ``ray get-auth-token --generate`` would, readable by its owner only: ``ray start``
    refuses to start without one."""
    if env.get("RAY_AUTH_TOKEN"):
        return Path()
    path = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    if not path.exists():
        import secrets

        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
    path.chmod(0o600)
    return path


def _start_recorded(cmd: list[str], env: dict, temp: str, gcs: int, dash: Optional[int], nm: int, cpus: int,
                    gpus: int, workers: int, worker_env: dict, auth_mode: str, owner_pid: Optional[int]) -> ClusterRecord:
    """``ray start`` the head in ``temp``, start the pool's keeper beside it, save the record."""
    log_path = Path(temp) / "ray-start.log"
    with open(log_path, "w") as log_file:
        done = subprocess.run(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                              timeout=START_TIMEOUT_S)
    raylet = _raylet_of(temp)
    if done.returncode != 0 or raylet is None:
        tail = log_path.read_text()[-600:].strip().splitlines()
        raise ValueError(f"ray start failed (status {done.returncode}): {tail[-1] if tail else 'no output'}")
    record = ClusterRecord(
        address=f"127.0.0.1:{gcs}", dashboard=f"http://127.0.0.1:{dash}" if dash is not None else None, temp_dir=temp,
        raylet_address=f"127.0.0.1:{nm}", raylet_pid=raylet, keeper_pid=None, cpus=float(cpus), gpus=float(gpus),
        workers=workers, worker_env=worker_env, environment=environment(), auth_mode=auth_mode, started=time.time(),
        owner_pid=owner_pid)
    satp_env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (_project_root(), env.get("PYTHONPATH")) if p))
    fork_socket = worker_env.get(forked_workers.SOCKET_VAR)
    if fork_socket:
        _start_logged([sys.executable, "-m", "runtime.forked_workers", "--serve", fork_socket], satp_env,
                      Path(temp) / forked_workers.LOG_NAME)
    keeper = _start_logged(
        [sys.executable, "-m", "runtime.pool_keeper", "--raylet-address", record.raylet_address,
         "--raylet-pid", str(raylet), "--gcs-address", record.address, "--workers", str(workers)]
        + (["--forked-workers"] if fork_socket else []), satp_env, Path(temp) / "satp-worker-pool.log")
    record.keeper_pid = keeper.pid
    record.save()
    return record


def _start_logged(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """Start one of the cluster's own processes beside it, in a session of its own, logging to ``log_path``."""
    with open(log_path, "w") as log_file:
        return subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=log_path.parent)


def _project_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def _gpus_on_this_machine() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _raylet_of(temp: str) -> Optional[int]:
    for proc in processes_of(temp):
        try:
            if proc.name() == "raylet":
                return proc.pid
        except Exception:
            continue
    return None


def wait_warm(record: ClusterRecord, timeout_s: float = START_TIMEOUT_S, progress=None) -> dict:
    """Wait until the pool holds its default processes, each done importing (idle on the CPU for
    half a second); return the census ``{kind: count}`` of available processes."""
    import psutil

    pool = record.pool()
    targets = worker_pool.default_targets(record.workers, forked=forked_workers.SOCKET_VAR in record.worker_env)
    deadline = time.monotonic() + timeout_s
    while True:
        available, _ = pool.census()
        ready = all(available.get(kind, 0) >= count for kind, count in targets.items())
        if ready:
            idle = [p for p in psutil.Process(record.raylet_pid).children()
                    if worker_pool.process_title(p.pid) == worker_pool.IDLE_TITLE]
            before = {p.pid: _cpu(p) for p in idle}
            time.sleep(0.5)
            if all(_cpu(p) == before[p.pid] for p in idle):
                return dict(available)
        if progress is not None:
            progress(sum(min(available.get(k, 0), n) for k, n in targets.items()), sum(targets.values()))
        if time.monotonic() > deadline:
            return dict(available)
        time.sleep(0.5)


def _cpu(proc) -> float:
    try:
        times = proc.cpu_times()
        return times.user + times.system
    except Exception:
        return -1.0


def processes_of(temp: str) -> list:
    """The processes of the cluster in ``temp``: those naming it on their command line (GCS,
    raylet, dashboard, ``ray start``'s own) or in ``TMPDIR``, and all their descendants (workers)."""
    import psutil

    roots = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid == os.getpid():
                continue
            tmpdir = worker_pool.process_environ(proc.pid).get("TMPDIR", "")
            if any(temp in part for part in proc.info["cmdline"] or ()) or tmpdir == temp or \
                    tmpdir.startswith(temp + os.sep):
                roots.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found = {p.pid: p for p in roots}
    for proc in roots:
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


#: Ray's autoscaler monitor: on SIGTERM it reports its end to the drivers through GCS, and waits on a GCS
#: that has gone until it is killed
MONITOR = "autoscaler/_private/monitor.py"
#: what of a cluster gets SIGTERM first, each once the one before has ended (a program's path ends so):
#: ``ray start --block``'s process (it stops its node in Ray's order itself, after draining it: Ray's
#: ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``), the monitor (SIGKILL once GCS has gone), the raylet (SIGTERMed
#: together with GCS it waited ~10 s, and GCS longer, for the kill after the grace: a stop took 8 s).
#: In this order the stop of a satp cluster takes <1 s
STOP_FIRST = ("bin/ray", MONITOR, "raylet/raylet")


def stop_processes(temp: str, grace_s: float = 8.0) -> int:
    """SIGTERM the cluster's processes (:data:`STOP_FIRST` first), SIGKILL what is left after ``grace_s``;
    return how many are left."""
    procs = stop_in_order(processes_of(temp), grace_s)
    procs += [p for p in processes_of(temp) if p not in procs]  # started meanwhile (a worker)
    return len(stop_in_order(procs, grace_s))


def stop_in_order(procs: list, grace_s: float = 8.0) -> list:
    """SIGTERM ``procs`` (psutil processes; :data:`STOP_FIRST` first, each waited for up to ``grace_s``),
    then SIGKILL what is left after ``grace_s``; return the processes still running."""
    gcs_alive = any(_runs(p, "gcs/gcs_server") and not _ended(p) for p in procs)
    for program in STOP_FIRST:
        sig = signal.SIGKILL if program == MONITOR and not gcs_alive else signal.SIGTERM
        _signal_and_wait([p for p in procs if _runs(p, program)], sig, grace_s)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        procs = _signal_and_wait(procs, sig, wait)
        if not procs:
            break
    return procs


def _runs(proc, program: str) -> bool:
    return any(part.endswith(program) for part in worker_pool.process_cmdline(proc))


def _signal_and_wait(procs: list, sig: int, timeout_s: float) -> list:
    """Send ``sig`` to the ``procs`` still running and wait until they have ended (a zombie has: see
    :func:`_ended`; psutil's ``wait_procs`` waits for it until its timeout); return those left."""
    import psutil

    procs = [p for p in procs if not _ended(p)]
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    signalled, deadline = procs, time.monotonic() + timeout_s
    while procs and time.monotonic() < deadline:
        time.sleep(0.05)
        procs = [p for p in procs if not _ended(p)]
    for proc in signalled:
        if proc not in procs:  # reaped where it is this process's child; another's zombie stays its parent's
            with contextlib.suppress(psutil.Error, ChildProcessError):
                proc.wait(timeout=0)
    return procs


def _ended(proc) -> bool:
    """Gone, or a zombie: ended, its status not yet collected by its parent (the keeper of a cluster
    that a process other than ``satp cluster start`` started, a test session, until it reaps it)."""
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop(record: Optional[ClusterRecord] = None) -> Optional[ClusterRecord]:
    """Stop the satp cluster: its keeper, every process of its folder, the folder, the record.
    Returns the record stopped (None: there was none). Raises ``ValueError`` when processes stay."""
    record = record or ClusterRecord.load()
    if record is None:
        return None
    left = stop_processes(record.temp_dir)
    if left:
        raise ValueError(f"satp cluster stop: {left} process(es) of {record.temp_dir} did not end; "
                         "stop them by hand (they carry that folder)")
    shutil.rmtree(record.temp_dir, ignore_errors=True)
    current = ClusterRecord.load()
    if current is not None and current.temp_dir == record.temp_dir:
        record_path().unlink(missing_ok=True)
    return record


def adopt_client_settings() -> None:
    """Set what this process needs to be a client of the satp cluster, before Ray is imported (Ray
    reads ``RAY_AUTH_MODE`` once, when it loads): commands call this first. A value the user set
    stays; without a record nothing changes."""
    try:
        record = ClusterRecord.load()
    except ValueError:
        return
    if record is not None:
        for key, value in record.connect_env().items():
            os.environ.setdefault(key, value)


def for_command(warn) -> Optional[ClusterRecord]:
    """The satp cluster a command without ``--address`` should use, or None (it starts its own).

    ``warn(line)`` is told, in one line, about a record whose cluster is gone (its leftovers are
    removed here) or that runs another Python environment (left running: ``satp cluster stop``)."""
    try:
        record = ClusterRecord.load()
    except ValueError as exc:
        warn(f"{exc}; this command starts its own local Ray")
        return None
    if record is None:
        return None
    if not record.alive():
        stop(record)
        warn(f"the satp cluster of {record_path()} (started {time.ctime(record.started)}) is gone; its "
             f"leftovers were removed and this command starts its own local Ray (satp cluster start: a warm one)")
        return None
    difference = record.environment_difference()
    if difference:
        warn(f"the satp cluster at {record.address} runs another Python environment ({difference}): not used, this "
             f"command starts its own local Ray (satp cluster stop, then satp cluster start from this environment)")
        return None
    return record
