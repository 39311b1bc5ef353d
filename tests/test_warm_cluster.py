"""``satp cluster``: a local Ray cluster kept warm (runtime/local_cluster.py, runtime/worker_pool.py).

The lifecycle runs for real in a ``SATP_HOME`` of its own (``satp cluster start``, two ``satp train``
commands at once on it, ``status``, a second ``start``, a cluster killed under its record, ``stop``);
the pool's bookkeeping and the clean-up of what killed commands left are checked below it.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from runtime import forked_workers, local_cluster, pool_keeper, ports, ray_cluster, worker_pool
from tests.helpers import tiny_job_dict

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- below Ray
def test_training_modules_leave_satp_to_the_run():
    """A warm process imports torch, PyG and DeepSpeed ahead, never satp's own modules: an edited
    checkout is what the next run imports."""
    code = ("import sys, runtime.run_imports as r; r.import_modules(r.TRAINING_MODULES); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pipeline', 'sat', 'preprocessing')), "
            "all(m in sys.modules for m in ('torch', 'torch_geometric', 'deepspeed', 'ray.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "True"]


def test_only_a_prestarted_process_of_a_train_runs_kinds_imports_ahead():
    """What every process of a satp cluster imports when it starts (the raylet's list, imported in
    order as Ray does, then the setup hook of the kinds that train): none of satp's training modules;
    torch, MLflow's store and pyplot (a Train run's kinds: Ray Train's controller variable), PyG and
    DeepSpeed (the kinds that train) only in a process started ahead of any job (the nil job id the
    raylet gives the pool's). One Ray started for a job's actor (the cleaner, the synchronization
    actor) imports only what its actor opens."""
    code = ("import importlib, os, sys, runtime.worker_pool as w, runtime.run_imports as r\n"
            "for name in w.PRELOAD_MODULES: importlib.import_module(name)\n"
            "if w.SETUP_HOOK_VAR in os.environ: r.import_training_modules()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pipeline', 'sat')), "
            "','.join(m for m in ('torch', 'mlflow.store.tracking.sqlalchemy_store', 'matplotlib.pyplot', "
            "'torch_geometric', 'deepspeed') if m in sys.modules) or '-')")
    controller, worker = worker_pool.train_run_kinds()
    outs = {}
    for job in ("ffffffff", "01000000"):
        for kind, extra in (("plain", {}), ("controller", dict(controller.env)), ("training", dict(worker.env))):
            env = {k: v for k, v in os.environ.items() if k not in dict(worker.env)}
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                                 env={**env, **extra, "RAY_JOB_ID": job})
            assert out.returncode == 0, out.stderr[-2000:]
            outs[job, kind] = out.stdout.split()
    run = "torch,mlflow.store.tracking.sqlalchemy_store,matplotlib.pyplot"
    assert outs == {("ffffffff", "plain"): ["[]", "-"], ("ffffffff", "controller"): ["[]", run],
                    ("ffffffff", "training"): ["[]", run + ",torch_geometric,deepspeed"],
                    **{("01000000", kind): ["[]", "-"] for kind in ("plain", "controller", "training")}}


OWN_CLUSTER_UNDER_A_DRIVER = r"""
import os, sys, threading, time, psutil, ray
from runtime import ray_cluster, worker_pool

ray_cluster.init_local_ray(num_cpus=2, warm_workers=1)
raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
keeper = next(t for t in threading.enumerate() if t.name == "satp-worker-pool")
keeper.join(timeout=float(sys.argv[1]))
inherited = sorted(set(worker_pool.process_environ(raylet.pid)) & worker_pool.RUNTIME_ENV_VARS)
started = len([p for p in raylet.children() if worker_pool.process_title(p.pid) == worker_pool.IDLE_TITLE
               or "default_worker.py" in " ".join(worker_pool.process_cmdline(p))])
print(inherited, keeper.is_alive(), started)
ray.shutdown()
"""


@pytest.mark.quiet  # the keeper prestarts on idle CPUs only
def test_a_commands_own_cluster_under_a_driver_that_set_the_runtime_env_variables_warms_one_run():
    """A command started by a process that had set what runtime environments set (a satp driver, a test
    session: Ray Train's preemption setting) gave those to its own cluster's raylet, so no worker was of
    a run's kind: the keeper prestarted a run's processes every 5 s without end (the suite's Ctrl-C test
    took 130 s, not 30), or never ended. The raylet now has none of them, and the keeper ends once one
    run's processes are there, having started that many (2 at once: the raylet's CPUs)."""
    env = {**os.environ, **worker_pool.LOCAL_TRAIN_ENV, "SATP_HOME": tempfile.mkdtemp()}
    out = subprocess.run([sys.executable, "-c", OWN_CLUSTER_UNDER_A_DRIVER, "120"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    inherited, keeper_alive, started = out.stdout.split()[-3:]
    assert (inherited, keeper_alive) == ("[]", "False"), out.stdout
    assert 1 <= int(started) <= sum(worker_pool.default_targets(1).values()), out.stdout


def test_kinds_are_written_as_ray_writes_them():
    from ray.runtime_env import RuntimeEnv

    controller, worker = worker_pool.train_run_kinds()
    assert dict(worker.env)[worker_pool.SETUP_HOOK_VAR] == "runtime.run_imports.import_training_modules"
    assert set(dict(controller.env).items()) < set(dict(worker.env).items())  # a worker merges its controller's
    # a driver's actor: Ray's Python side; one merged under its creator's environment: compact
    assert worker_pool.serialized(controller, merged=False) == RuntimeEnv(env_vars=dict(controller.env)).serialize()
    compact = worker_pool.serialized(worker, merged=True)
    assert " " not in compact and json.loads(compact) == {"env_vars": dict(worker.env)}


def test_a_request_counts_until_its_processes_show_or_it_expires():
    kind = worker_pool.Kind.of({"A": "1"})
    requests = pool_keeper.Requests(ttl_s=5.0)
    requests.add(kind, seen=1, count=2, now=100.0)
    assert requests.counted(collections.Counter({kind: 1}), now=101.0)[kind] == 3  # not asked again
    assert requests.counted(collections.Counter({kind: 3}), now=102.0)[kind] == 3  # seen: forgotten
    requests.add(kind, seen=0, count=2, now=200.0)
    assert requests.counted(collections.Counter(), now=206.0)[kind] == 0  # dropped by the raylet: asked again


def test_usage_keeps_the_most_in_use_at_once_within_its_window():
    a, b = worker_pool.Kind.of({"A": "1"}), worker_pool.Kind.of({"B": "1"})
    usage = pool_keeper.UsageMemory(window_s=60.0)
    usage.add(collections.Counter({a: 3}), now=0.0)
    usage.add(collections.Counter({a: 1, b: 2}), now=30.0)
    assert usage.peaks() == {a: 3, b: 2}
    usage.add(collections.Counter(), now=75.0)
    assert usage.peaks() == {a: 1, b: 2}


def test_the_pool_holds_one_run_and_one_round_of_starts_at_most():
    """However many kinds a long session has used (a sweep, a test session: each kind's peak in the
    window), the pool keeps one run's processes first and tops up to its limit with the most used."""
    defaults = worker_pool.default_targets(2)
    limit = pool_keeper.warm_limit(defaults, starts_at_once=2)
    assert limit == 1 + 2 + 2
    trial, plain, other = (worker_pool.Kind.of({"PL_DISABLE_FORK": "1"}), worker_pool.Kind(),
                           worker_pool.Kind.of({"X": "1"}))
    wanted = {**defaults, trial: 6, plain: 1, other: 3}
    kept = pool_keeper.within_limit(wanted, defaults, limit)
    assert sum(kept.values()) == limit
    assert all(kept[kind] == count for kind, count in defaults.items())
    assert kept == {**defaults, trial: 2}
    assert pool_keeper.within_limit(defaults, defaults, limit) == defaults


def test_the_defaults_are_prestarted_when_idle_processes_of_other_kinds_fill_the_limit():
    """Ray keeps idle processes of a finished job's kinds (as many as its CPUs) for good: counted
    against the limit, they held a test's warm controller back for minutes (the suite's two-commands
    test waited 5 x 120 s). The keeper's one round against a raylet whose idle processes are all such."""
    controller, _ = worker_pool.train_run_kinds()
    stray = worker_pool.Kind.of({"__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "a.finished.jobs.hook"})

    class RayletWithStrays:  # the census a raylet gives then; what the keeper asks of it, recorded
        starts_at_once = 2

        def __init__(self) -> None:
            self.rounds, self.asked = 0, []

        def alive(self) -> bool:
            self.rounds += 1
            return self.rounds == 1

        def end_orphaned_cleaners(self) -> int:
            return 0

        def census(self):
            return collections.Counter({stray: 3}), collections.Counter()

        def top_up(self, targets, available, most):
            self.asked.append((dict(targets), most))
            return {}

    raylet = RayletWithStrays()
    pool_keeper.keep_warm(raylet, {controller: 1}, interval_s=0.0, once=True)  # once: whatever the CPUs do
    assert raylet.asked == [({controller: 1}, 1)]


def test_the_cpu_counts_as_busy_while_any_sample_of_its_window_was():
    cpus = pool_keeper.CpuBusy(percent=60.0, window_s=3.0)
    cpus.add(95.0, now=0.0)
    cpus.add(10.0, now=2.0)
    assert cpus.was_busy()
    cpus.add(10.0, now=3.5)  # the busy sample left the window
    assert not cpus.was_busy()


def test_free_ports_lie_below_the_ephemeral_range_where_no_outgoing_connection_takes_them(monkeypatch, tmp_path):
    """A Ray node's ports: distinct, free, and out of the range the kernel gives outgoing connections
    (read from /proc; one that starts too low for a pick below it leaves the choice to the kernel)."""
    import socket

    low, high = map(int, ports.EPHEMERAL_PORTS.read_text().split())
    picked = ports.free_ports(9)
    assert len(set(picked)) == 9 and all(ports.LOWEST_PORT <= port < low for port in picked), (picked, low)
    for port in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    too_low = tmp_path / "ip_local_port_range"
    too_low.write_text(f"{ports.LOWEST_PORT}\t{high}\n")
    monkeypatch.setattr(ports, "EPHEMERAL_PORTS", too_low)
    assert all(low <= port <= high for port in ports.free_ports(3))


def test_what_a_killed_command_left_is_removed_and_a_live_ones_folder_kept(tmp_path):
    """A command killed with SIGKILL leaves its local cluster's private folder and, possibly, Ray
    processes carrying it (a Train worker still writing a checkpoint): the next command stops those
    processes and removes the folder; a running command's folder is left alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tmp = Path(tempfile.gettempdir())
    left = Path(tempfile.mkdtemp(prefix=f"{ray_cluster.ORPHAN_PREFIX}{gone.pid}-", dir=tmp))
    live = Path(tempfile.mkdtemp(prefix=f"{ray_cluster.ORPHAN_PREFIX}{os.getpid()}-", dir=tmp))
    straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 env=dict(os.environ, TMPDIR=str(left)))
    try:
        removed = ray_cluster.sweep_orphans()
        assert str(left) in removed and not left.exists()
        assert not psutil.pid_exists(straggler.pid)  # stopped (and reaped by the sweep, its parent here)
        assert live.is_dir() and str(live) not in removed
    finally:
        straggler.kill()
        live.rmdir()


def test_the_workers_get_only_the_environment_their_cluster_lacks(monkeypatch):
    needed = {"DS_ACCELERATOR": "cpu", "OUTDATED_IGNORE": "1"}
    monkeypatch.setattr(ray_cluster, "_worker_env", {"DS_ACCELERATOR": "cpu", "OUTDATED_IGNORE": "1"})
    assert ray_cluster.missing_worker_env(needed) == {}
    monkeypatch.setattr(ray_cluster, "_worker_env", {"DS_ACCELERATOR": "cuda"})
    assert ray_cluster.missing_worker_env(needed) == needed
    monkeypatch.setattr(ray_cluster, "_worker_env", None)  # a cluster satp did not start: all of it
    assert ray_cluster.missing_worker_env(needed) == needed


def test_a_cpu_clusters_train_workers_are_forked_by_its_fork_server_and_not_kept_warm(monkeypatch, tmp_path):
    """A satp cluster names its fork server to its processes; a run's driver then gives its Train
    workers the server's client as their Python, unless they train on GPUs; the pool keeps no worker
    process of theirs (their runtime environment is another one), only the controller's."""
    from pipeline.config import JobConfig
    from pipeline.train.driver import worker_runtime_env

    sock = str(tmp_path / "worker-fork.sock")
    env = local_cluster.cluster_env(use_gpu=False, api_server="http://127.0.0.1:9", fork_socket=sock)
    assert env[forked_workers.SOCKET_VAR] == sock
    assert forked_workers.SOCKET_VAR not in local_cluster.cluster_env(use_gpu=True, api_server="http://127.0.0.1:9")
    job = JobConfig.model_validate(tiny_job_dict(tmp_path, epochs=1))
    monkeypatch.setattr(ray_cluster, "_worker_env", env)
    assert worker_runtime_env(job)["py_executable"].split()[-2:] == ["--client", sock]
    gpu = JobConfig.model_validate({**tiny_job_dict(tmp_path, epochs=1), "resources": {"use_gpu": True}})
    assert "py_executable" not in worker_runtime_env(gpu)
    monkeypatch.setattr(ray_cluster, "_worker_env", {k: v for k, v in env.items() if k != forked_workers.SOCKET_VAR})
    assert "py_executable" not in worker_runtime_env(job)
    # a cluster satp did not start: the server its driver's environment names (docs/scale.md)
    monkeypatch.setattr(ray_cluster, "_worker_env", None)
    monkeypatch.setenv(forked_workers.SOCKET_VAR, sock)
    assert worker_runtime_env(job)["py_executable"].split()[-2:] == ["--client", sock]
    assert "py_executable" not in worker_runtime_env(gpu)
    controller, _ = worker_pool.train_run_kinds()
    assert worker_pool.default_targets(2, forked=True) == {controller: 1}


# ----------------------------------------------------------------------------- the real cluster
def _env(home: Path) -> dict:
    env = dict(os.environ, SATP_HOME=str(home), TQDM_DISABLE="1")
    env.pop("RAY_ADDRESS", None)
    return env


def _satp(args: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def _maps(pid: int, library: str) -> bool:
    """Whether process ``pid`` has a shared library named ``library`` loaded (what importing torch does)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # ended meanwhile
        return False


@pytest.mark.quiet  # the pool refills on idle CPUs only
@pytest.mark.ray
@pytest.mark.slow
def test_two_commands_at_once_run_on_the_warm_session_cluster(tiny_setting, tmp_path):
    """The session's cluster is a satp cluster (conftest: ``local_cluster.start``, what ``satp cluster
    start`` runs): ``satp cluster status`` names it and its warm kinds, a second ``start`` is refused
    in one line, and two ``satp train`` at once both run on it, their Train workers forked by the
    cluster's fork server, and the pool counts their controllers, not Train's helper actors, as their
    kind's use."""
    base, _ = tiny_setting
    home = Path(os.environ["SATP_HOME"])
    env = _env(home)
    record = local_cluster.ClusterRecord.load()
    controller, _ = worker_pool.train_run_kinds()
    pool = record.pool()
    for _ in range(5):  # the pool's one controller process may end its keep-alive and be replaced meanwhile
        local_cluster.wait_warm(record)  # the pool refills on idle CPUs: the tests before may have kept them busy
        waiting = {p.pid: _maps(p.pid, "libtorch") for p in psutil.Process(record.raylet_pid).children()
                   if worker_pool.process_title(p.pid) == worker_pool.IDLE_TITLE and pool.kind_of(p.pid) == controller}
        if waiting:
            break
    assert waiting and all(waiting.values()), f"the pool's controller processes imported torch ahead: {waiting}"
    status = _satp(["cluster", "status"], env)
    assert status.returncode == 0 and record.address in status.stdout
    assert "Train workers forked from its fork server" in status.stdout, status.stdout
    # the kind the pool keeps warm, named without the settings every local run has (LOCAL_TRAIN_ENV)
    assert re.search(r"^  train-controller +warm +\d", status.stdout, re.M), status.stdout

    again = _satp(["cluster", "start"], env)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1] == (
        f"satp: error: a satp cluster runs already at {record.address} (record {home / 'cluster.json'}); "
        "satp cluster stop stops it")

    procs = []
    for name in ("first", "second"):
        values = tiny_job_dict(base, epochs=1, run_name=name, storage_path=str(tmp_path / "ray"), train_subset=200,
                               eval_subset=60)
        values["resources"]["num_workers"] = 1
        values["mlflow"]["enabled"] = False
        job = tmp_path / f"{name}.yaml"
        job.write_text(yaml.safe_dump(values))
        procs.append(subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", str(job), "--no-progress"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))
        time.sleep(2)
    # the pool counts the runs' controllers as their kind's use, not Train's helpers beside them
    # (started on demand, light): it keeps no torch-importing process for them
    counted, helpers, done = [], set(), threading.Event()

    def census() -> None:
        while not done.wait(0.5):
            counted.append(pool.census()[1][controller])
            helpers.update(worker_pool.actor_class(worker_pool.process_title(p.pid))
                           for p in psutil.Process(record.raylet_pid).children())

    sampler = threading.Thread(target=census, daemon=True)
    sampler.start()
    try:
        outputs = [p.communicate(timeout=900) for p in procs]
    finally:
        done.set()
        sampler.join(timeout=30)
    assert "SynchronizationActor" in helpers, helpers
    assert not helpers & {"PlacementGroupCleaner", "DatasetManager"}, helpers  # satp's runs need neither
    assert 0 < max(counted, default=0) <= 2, counted
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
        assert "starting a local Ray cluster" not in err  # both ran on the satp cluster
    lines = [line for _, err in outputs for line in err.splitlines() if "start-up" in line and "first step" in line]
    # the session cluster has no GPU: its fork server forked both runs' Train workers
    assert len(lines) == 2 and all(line.endswith("(forked worker process)") for line in lines), lines


@pytest.mark.ray
def test_a_start_interrupted_before_its_record_leaves_nothing(tmp_path):
    """Ctrl-C while ``ray start`` starts the head (its GCS up, no record yet): the interrupted start
    stops what it started and removes its folder; no record is written."""
    code = ("from runtime import local_cluster; "
            "local_cluster.start(num_cpus=1, num_gpus=0, workers=1, dashboard=False, wait=False)")
    before = set(Path("/tmp").glob("satpc-*"))
    proc = subprocess.Popen([sys.executable, "-c", code], env=_env(tmp_path), cwd=ROOT, stderr=subprocess.PIPE,
                            text=True)

    def its_folders() -> list[Path]:  # not those of clusters other tests start meanwhile
        try:
            lines = [" ".join(worker_pool.process_cmdline(p)) for p in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        return [f for f in Path("/tmp").glob("satpc-*") if f not in before and any(str(f) in line for line in lines)]

    deadline = time.monotonic() + 120
    folders: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None and not any(
            p.name() == "gcs_server" for folder in folders for p in local_cluster.processes_of(str(folder))):
        folders = its_folders()
        time.sleep(0.1)
    assert proc.poll() is None and len(folders) == 1, "ray start ended before its GCS was seen"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
    assert local_cluster.processes_of(str(folders[0])) == [] and not folders[0].exists()
    assert not (tmp_path / "cluster.json").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_a_cluster_stopped_or_gone_under_its_record_leaves_nothing(tmp_path, monkeypatch):
    """One of another Python environment is named and left alone; ``satp cluster stop`` leaves no
    process, folder or record; a satp cluster that died (here: its raylet and GCS killed, as a crash
    or a reboot would) is named in one line by the next command, which removes what is left and
    starts its own."""
    monkeypatch.setenv("SATP_HOME", str(tmp_path))
    record = local_cluster.start(num_cpus=1, num_gpus=0, workers=1, dashboard=False, wait=False)
    try:
        record.environment = dict(record.environment, torch="0.0.1")
        record.save()
        lines: list[str] = []
        assert local_cluster.for_command(lines.append) is None
        assert lines == [f"the satp cluster at {record.address} runs another Python environment (torch 0.0.1 (this "
                         f"command: {local_cluster.environment()['torch']})): not used, this command starts its own "
                         "local Ray (satp cluster stop, then satp cluster start from this environment)"]
        assert record.alive()  # left running: it may be someone else's

        stopped = _satp(["cluster", "stop"], _env(tmp_path))
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        assert stopped.stdout.strip() == f"stopped the satp cluster at {record.address}; removed {record.temp_dir}"
        assert not Path(record.temp_dir).exists() and not (tmp_path / "cluster.json").exists()
        assert local_cluster.processes_of(record.temp_dir) == []

        record = local_cluster.start(num_cpus=1, num_gpus=0, workers=1, dashboard=False, wait=False)
        for proc in local_cluster.processes_of(record.temp_dir):
            if proc.name() in ("raylet", "gcs_server"):
                proc.kill()
        deadline = time.monotonic() + 30
        while record.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        lines.clear()
        assert local_cluster.for_command(lines.append) is None
        assert len(lines) == 1 and lines[0].startswith(f"the satp cluster of {tmp_path / 'cluster.json'} (started ")
        assert lines[0].endswith("is gone; its leftovers were removed and this command starts its own local Ray "
                                 "(satp cluster start: a warm one)")
        assert local_cluster.ClusterRecord.load() is None and not Path(record.temp_dir).exists()
        assert local_cluster.processes_of(record.temp_dir) == []
    finally:
        local_cluster.stop(record)
