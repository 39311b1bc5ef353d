"""``satp cluster``: one local Ray cluster that outlives commands, private to its user, on loopback.

``satp cluster start`` starts a head node and, on a CPU-only machine, a fork server
(:mod:`runtime.fork_server`); every satp command without ``--address`` in the same Python environment
then uses it (:func:`for_command`). Everything lies in a 0700 folder (:func:`check_private`), Ray's
token authentication is on, every port on 127.0.0.1 (docs/security.md).
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

from runtime import fork_server, interrupts
from runtime.ports import free_ports

#: packages whose versions are part of the environment a warm process runs (what it imported ahead)
ENVIRONMENT_PACKAGES = ("torch", "torch_geometric", "deepspeed", "ray", "mlflow", "numpy", "pyarrow")
START_TIMEOUT_S = 120.0
LOOPBACK = "127.0.0.1"
#: where a cluster's private folder is made: short, as Ray's socket paths in it must fit 107 bytes
TEMP_ROOT = "/tmp"
#: read by Ray's processes when they import Ray: a node address they work out themselves is 127.0.0.1
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def check_private(record_or_folder, advice: str = "satp cluster stop, then satp cluster start") -> None:
    """Raise a one-line ``ValueError`` ending in ``advice`` unless the (cluster's) folder is this user's, mode 0700."""
    folder = Path(getattr(record_or_folder, "folder", record_or_folder))
    try:
        st = folder.stat()
    except FileNotFoundError:
        raise ValueError(f"{folder}: the satp cluster's folder is gone; satp cluster stop removes what is left") from None
    mode = st.st_mode & 0o777
    if st.st_uid != os.getuid() or mode != 0o700:
        raise ValueError(f"{folder}: mode {mode:o} of user id {st.st_uid}, expected 700 of user id {os.getuid()}: "
                         f"not used (another user may have entered it); {advice}")


def user_folder() -> str:
    """``/tmp/satp-UID``, made 0700 on first use: Ray's folder for a command's own local Ray (Ray's
    ``/tmp/ray`` is open to every user); refused in one line when another user's or widened."""
    folder = Path(TEMP_ROOT) / f"satp-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    check_private(folder, "remove it (or narrow it to 700) and run the command again")
    return str(folder)


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
    folder: str  # the cluster's private folder (0700): Ray's temporary folder, its fork server's socket
    raylet_pid: int
    cpus: float
    gpus: float
    worker_env: dict[str, str]  # what the cluster's processes have in their environment
    environment: dict[str, str]
    auth_mode: str  # Ray's RAY_AUTH_MODE of the cluster
    started: float
    fork_socket: Optional[str] = None  # its fork server's socket (a CPU-only cluster)

    def save(self) -> None:
        path = record_path()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.chmod(0o700)  # $SATP_HOME, narrowed to 0700
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls) -> Optional["ClusterRecord"]:
        path, known = record_path(), {f.name for f in dataclasses.fields(cls)}
        try:  # a key this version does not know (another version's record) is left out
            return cls(**{k: v for k, v in json.loads(path.read_text()).items() if k in known})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not a satp cluster record ({exc}); remove it (satp cluster stop)") from None

    def alive(self) -> bool:
        """The head's raylet runs and its GCS accepts connections."""
        import psutil

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
        """What a client process needs in its environment to connect, before it imports Ray (which reads
        it then), besides :data:`LOOPBACK_ENV`: the cluster's authentication."""
        return {"RAY_AUTH_MODE": self.auth_mode} if self.auth_mode == "token" else {}


def cluster_env(use_gpu: bool, api_server: str, fork_socket: Optional[str] = None) -> dict[str, str]:
    """The environment of a satp cluster's processes (inherited by every worker the raylet starts).
    ``api_server``: the dashboard Ray Train's placement-group cleaner asks (else it may ask another
    cluster of the machine, and remove our placement group). ``fork_socket``: the cluster's fork server."""
    return {
        "OUTDATED_IGNORE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "DS_ACCELERATOR": "cuda" if use_gpu else "cpu",
        "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",  # the log monitor polls every 0.5 s, not 0.1 s
        "RAY_API_SERVER_ADDRESS": api_server,
        **({fork_server.SOCKET_VAR: fork_socket} if fork_socket else {}),
    }


def start(num_cpus: Optional[int] = None, num_gpus: Optional[int] = None, dashboard: bool = True,
          wait: bool = True, host: str = LOOPBACK) -> ClusterRecord:
    """Start the satp cluster; raise a one-line ``ValueError`` when one runs already. ``wait``: return
    once its fork server answers. ``host``: the node's address (another than 127.0.0.1 needs token
    authentication)."""
    existing = ClusterRecord.load()
    if existing is not None and existing.alive():
        raise ValueError(f"a satp cluster runs already at {existing.address} (record {record_path()}); "
                         "satp cluster stop stops it")
    auth_mode = os.environ.get("RAY_AUTH_MODE") or "token"
    if auth_mode != "token" and host != LOOPBACK:
        raise ValueError(f"--host {host}: a cluster other hosts reach runs with Ray's token authentication, "
                         f"not RAY_AUTH_MODE={auth_mode}")
    if existing is not None:
        stop(existing)
    cpus = int(num_cpus if num_cpus is not None else os.cpu_count() or 1)
    gpus = int(num_gpus if num_gpus is not None else _gpus_on_this_machine())
    folder = tempfile.mkdtemp(prefix="satpc-", dir=TEMP_ROOT)  # 0700
    (Path(folder) / "tmp").mkdir(mode=0o700)
    gcs, dash, client, agent_http, agent_grpc, metrics, rt_env, nm, om = free_ports(9)
    # a CPU-only cluster forks its processes (a process that initialised CUDA cannot fork one that uses it)
    fork_socket = None if gpus else str(Path(folder) / fork_server.SOCKET_NAME)
    worker_env = cluster_env(use_gpu=gpus > 0, api_server=f"http://{host}:{dash if dashboard else 9}",
                             fork_socket=fork_socket)
    env = dict(os.environ, **worker_env, **LOOPBACK_ENV, TMPDIR=str(Path(folder) / "tmp"))
    # a node other hosts reach works out its other addresses itself: LOOPBACK_ENV would name 127.0.0.1 there
    for key in ["RAY_ADDRESS"] + ([] if host == LOOPBACK else list(LOOPBACK_ENV)):
        env.pop(key, None)
    env["RAY_AUTH_MODE"] = auth_mode
    if auth_mode == "token":
        private_token(env)
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", f"--node-ip-address={host}", f"--port={gcs}",
           f"--num-cpus={cpus}", f"--num-gpus={gpus}", f"--temp-dir={Path(folder) / 'ray'}", "--disable-usage-stats",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={rt_env}", f"--node-manager-port={nm}", f"--object-manager-port={om}"]
    cmd += [f"--dashboard-host={host}", f"--dashboard-port={dash}"] if dashboard else ["--include-dashboard=false"]
    try:
        if fork_socket:  # importing while Ray starts; satp's checkout as its cwd, which `-m runtime...` imports from
            with open(Path(folder) / fork_server.LOG_NAME, "w") as log_file:
                subprocess.Popen([sys.executable, "-m", "runtime.fork_server", "--serve", fork_socket], env=env,
                                 stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                 cwd=Path(__file__).resolve().parents[1])
        log_path = Path(folder) / "ray-start.log"
        with open(log_path, "w") as log_file:
            done = subprocess.run(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                  timeout=START_TIMEOUT_S)
        raylet = _raylet_of(folder)
        if done.returncode != 0 or raylet is None:
            tail = log_path.read_text()[-600:].strip().splitlines()
            raise ValueError(f"ray start failed (status {done.returncode}): {tail[-1] if tail else 'no output'}")
        record = ClusterRecord(
            address=f"{host}:{gcs}", dashboard=f"http://{host}:{dash}" if dashboard else None, folder=folder,
            raylet_pid=raylet, cpus=float(cpus), gpus=float(gpus), worker_env=worker_env, environment=environment(),
            auth_mode=auth_mode, started=time.time(), fork_socket=fork_socket)
        record.save()
        check_private(record)  # Ray started: its folder above Ray's is still its user's only
        if wait and fork_socket and not fork_server.wait_ready(fork_socket, START_TIMEOUT_S):
            raise ValueError(f"the fork server did not answer on {fork_socket} within {START_TIMEOUT_S:g} s "
                             f"(its log: {Path(folder) / fork_server.LOG_NAME})")
    except BaseException:  # failed, or interrupted (Ctrl-C, a timeout): nothing left running
        with interrupts.deferred():  # a second Ctrl-C does not cut the clean-up short
            stop_processes(folder)
            shutil.rmtree(folder, ignore_errors=True)
            current = ClusterRecord.load() if record_path().exists() else None
            if current is not None and current.folder == folder:
                record_path().unlink(missing_ok=True)
        raise
    return record


def private_token(env: dict) -> Path:
    """The token Ray's token authentication reads (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``),
    made 0600 on first use (``ray start`` refuses to start without one)."""
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
        with contextlib.suppress(Exception):
            if proc.name() == "raylet":
                return proc.pid
    return None


def _cmdline(proc) -> list:
    try:
        return proc.cmdline()
    except Exception:  # gone, or another user's
        return []


def processes_of(temp: str) -> list:
    """The processes of the cluster in ``temp``: those naming it on their command line (GCS,
    raylet, dashboard, ``ray start``'s own, the fork server) or in ``TMPDIR``, and all their
    descendants (workers, forked processes)."""
    import psutil

    roots = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            tmpdir = proc.environ().get("TMPDIR", "")
        except Exception:  # gone, or another user's
            tmpdir = ""
        if any(temp in part for part in proc.info["cmdline"] or ()) or tmpdir == temp or \
                tmpdir.startswith(temp + os.sep):
            roots.append(proc)
    found = {p.pid: p for p in roots}
    for proc in roots:
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


#: Ray's autoscaler monitor: it waits on a GCS that has gone until it is killed
MONITOR = "autoscaler/_private/monitor.py"
#: what of a cluster gets SIGTERM first, each once the one before has ended (a program's path ends so):
#: ``ray start --block``'s process (it stops its node in Ray's order), the monitor, the raylet; in this
#: order a stop takes <1 s, not the raylet's and GCS's grace periods
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
    return any(part.endswith(program) for part in _cmdline(proc))


def _signal_and_wait(procs: list, sig: int, timeout_s: float) -> list:
    """Send ``sig`` to the ``procs`` still running and wait until they have ended (:func:`_ended`);
    return those left."""
    import psutil

    procs = [p for p in procs if not _ended(p)]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)
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
    """Gone, or a zombie (ended, its status not yet collected by its parent)."""
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop(record: Optional[ClusterRecord] = None) -> Optional[ClusterRecord]:
    """Stop the satp cluster: every process of its folder, the folder, the record. Returns the record
    stopped (None: there was none); raises ``ValueError`` when processes stay."""
    record = record or ClusterRecord.load()
    if record is None:
        return None
    left = stop_processes(record.folder)
    if left:
        raise ValueError(f"satp cluster stop: {left} process(es) of {record.folder} did not end; "
                         "stop them by hand (they carry that folder)")
    shutil.rmtree(record.folder, ignore_errors=True)
    current = ClusterRecord.load()
    if current is not None and current.folder == record.folder:
        record_path().unlink(missing_ok=True)
    return record


def for_command(warn) -> Optional[ClusterRecord]:
    """The satp cluster a command without ``--address`` should use, or None (it starts its own);
    ``warn(line)`` is told about a record whose cluster is gone (its leftovers removed here) or that
    runs another Python environment (left running)."""
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
    check_private(record)
    difference = record.environment_difference()
    if difference:
        warn(f"the satp cluster at {record.address} runs another Python environment ({difference}): not used, this "
             f"command starts its own local Ray (satp cluster stop, then satp cluster start from this environment)")
        return None
    return record
