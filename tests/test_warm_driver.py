"""The warm driver (``pipeline/cli/warm_driver.py``): ``satp train`` forked from a process that imported
satp's driver. One real warm driver process for the module; the command's side is
:func:`pipeline.cli.warm_driver.run_command` in a process of its own (what ``satp train`` calls on a satp
cluster started with ``--warm-driver``)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import is_running, process_state, tiny_subset_job

ROOT = Path(__file__).resolve().parents[1]
#: the command's process: run_command with its own pid as the signal hook's target (a fault that
#: signals "the satp process" then reaches the caller, which forwards it); 99: not forked
CLIENT = """
import json, os, sys
from pipeline.cli.warm_driver import run_command
fault = json.loads(os.environ.get("SATP_TEST_FAULT") or "null")
if fault:
    os.environ["SATP_TEST_FAULT"] = json.dumps(dict(fault, pid=os.getpid()))
code = run_command(sys.argv[1], sys.argv[2:], lambda line: print("not forked:", line, file=sys.stderr))
sys.exit(99 if code is None else code)
"""


@pytest.fixture(scope="module")
def warm_driver(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm-driver")
    path = folder / "warm-driver.sock"
    # the environment of the driver and of every command here (this process's own changes once it
    # joins Ray, such as Ray's client mode, are not a command's)
    env = {**os.environ, "SATP_TEST_FAULT": ""}
    with open(folder / "warm-driver.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "pipeline.cli.warm_driver", "--socket", str(path)], cwd=ROOT,
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while not path.exists():
        assert server.poll() is None and time.monotonic() < deadline, (folder / "warm-driver.log").read_text()[-3000:]
        time.sleep(0.2)
    yield {"socket": str(path), "server": server, "env": env}
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=60)


def _command(warm_driver, argv: list[str], cwd: Path, fault: dict | None = None, **env) -> subprocess.Popen:
    environment = {**warm_driver["env"], "SATP_TEST_FAULT": json.dumps(fault) if fault else "", **env}
    return subprocess.Popen([sys.executable, "-c", CLIENT, warm_driver["socket"], *argv], cwd=cwd, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _signalled_run(warm_driver, tiny_setting, tmp_path: Path, run_name: str, signal_name: str):
    """``(command, its stderr, the warm driver's descendants seen meanwhile)``: the tiny job (3 epochs)
    on the session cluster, forked by the warm driver; after epoch 0's checkpoint the run sends
    ``signal_name`` to the command's process."""
    base, address = tiny_setting
    job = tiny_subset_job(base, tmp_path, run_name, epochs=3)
    fault = {"signal": signal_name, "epoch": 0, "marker": str(tmp_path / "fired")}
    command = _command(warm_driver, ["train", str(job), "--address", address, "--no-progress"], tmp_path, fault)
    seen, done = set(), threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            seen.update(_forked(warm_driver))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _, err = command.communicate(timeout=600)
    finally:
        done.set()
        watcher.join()
    return command, err, seen


def _forked(warm_driver) -> list[int]:
    """A runner and its command per command under way: the warm driver's children and theirs. Not
    what the command starts in turn (its ``git rev-parse``, a moment long, was once seen here too)."""
    import psutil

    runners = psutil.Process(warm_driver["server"].pid).children()
    commands = []
    for runner in runners:
        with contextlib.suppress(psutil.NoSuchProcess):
            commands += runner.children()
    return [p.pid for p in runners + commands]


def test_code_and_import_time_settings_decide_whether_a_command_is_forked(tmp_path):
    from pipeline.cli.warm_driver import code_fingerprint, difference, identity

    (tmp_path / "pipeline").mkdir()
    module = tmp_path / "pipeline" / "a.py"
    module.write_text("x = 1\n")
    before = code_fingerprint(tmp_path)
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 1))  # edited, same size
    assert code_fingerprint(tmp_path) != before
    mine = identity({"RAY_AUTH_MODE": "token", "PATH": "/bin"})
    assert difference(mine, identity({"RAY_AUTH_MODE": "token", "PATH": "/usr/bin", "SATP_TEST_FAULT": "x",
                                      "RAY_COLOR_PREFIX": "0"})) is None  # read later, or never at import
    assert difference(mine, identity({"RAY_AUTH_MODE": "token", "DS_ACCELERATOR": "cuda"})) == \
        "another DS_ACCELERATOR in the environment"
    # a caller that imported Ray carries the RAY_CLIENT_MODE=0 its import set, which reads as unset
    assert difference(mine, identity({"RAY_AUTH_MODE": "token", "RAY_CLIENT_MODE": "0"})) is None
    assert difference(mine, identity({"RAY_AUTH_MODE": "token", "RAY_CLIENT_MODE": "1"})) == \
        "another RAY_CLIENT_MODE in the environment"
    assert difference(mine, dict(mine, code="edited")) == "satp's code changed since it started"
    assert difference(mine, dict(mine, root="/elsewhere", code="other")) == "satp's code of another folder (/elsewhere)"


def test_a_forked_command_has_the_callers_directory_streams_and_status(warm_driver, tmp_path):
    done = _command(warm_driver, ["train", "missing.yaml"], tmp_path)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 2, err
    assert err.strip().splitlines() == [f"satp: error: {tmp_path}/missing.yaml: job file not found"], err


def test_a_command_with_other_import_time_settings_runs_in_its_own_process(warm_driver, tmp_path):
    done = _command(warm_driver, ["train", "missing.yaml"], tmp_path, RAY_SATP_TEST_SETTING="1")
    out, err = done.communicate(timeout=120)
    assert done.returncode == 99, err
    assert err.strip().splitlines() == [
        "not forked: the satp cluster's warm driver did not run this command (another RAY_SATP_TEST_SETTING in "
        "the environment); it runs in its own process"], err


@pytest.mark.ray
@pytest.mark.slow
def test_a_signal_to_the_command_reaches_the_forked_run_and_ends_the_command_as_it(warm_driver, tiny_setting, tmp_path):
    stopped, err, _ = _signalled_run(warm_driver, tiny_setting, tmp_path, "wd-term", "SIGTERM")
    assert stopped.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("satp: interrupted (SIGTERM): run wd-term kept its checkpoint of epoch 0"), last
    deadline = time.monotonic() + 30
    while _forked(warm_driver) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _forked(warm_driver)


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_command_takes_its_forked_run_with_it(warm_driver, tiny_setting, tmp_path):
    killed, err, forked = _signalled_run(warm_driver, tiny_setting, tmp_path, "wd-kill", "SIGKILL")
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    # the run's lease names the command's own process (the one a user started, and sees in ps)
    assert json.loads((tmp_path / "ray" / "wd-kill" / "satp-lease.json").read_text())["pid"] == killed.pid
    assert len(forked) == 2, forked  # its runner and the forked command, SIGKILLed by the runner
    deadline = time.monotonic() + 30
    while any(map(is_running, forked)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(map(is_running, forked)) and not _forked(warm_driver)


def test_an_address_names_the_satp_cluster_on_any_address_of_this_machine():
    from runtime.local_cluster import ClusterRecord

    record = ClusterRecord(address="127.0.0.1:6390", dashboard=None, temp_dir="/nonexistent", raylet_address="127.0.0.1:1",
                           raylet_pid=1, keeper_pid=None, cpus=1.0, gpus=0.0, workers=1, worker_env={}, environment={},
                           auth_mode="token", started=0.0)
    assert record.named_by("127.0.0.1:6390") and record.named_by("localhost:6390")
    assert not record.named_by("127.0.0.1:6391")  # another cluster of this machine
    assert not record.named_by("198.51.100.7:6390")  # not this machine (TEST-NET-2)
    assert not record.named_by("ray://127.0.0.1:6390")  # Ray Client: another kind of driver


@pytest.mark.ray
def test_a_command_naming_the_session_cluster_is_forked_by_its_warm_driver_a_library_call_is_not(ray_cluster, tmp_path):
    """The session's satp cluster runs a warm driver (conftest), as ``satp cluster start --warm-driver``
    does: a ``satp train`` process that names the cluster by the address Ray gives it (the machine's
    network address, not the record's 127.0.0.1) is forked by it; ``main(argv)`` called as a library
    function runs in the caller's process."""
    from pipeline.cli import main
    from pipeline.cli.warm_driver import LOG_NAME
    from runtime.local_cluster import ClusterRecord

    record = ClusterRecord.load()
    deadline = time.monotonic() + 300
    while not Path(record.driver_socket).exists():  # started with the cluster, not waited for
        assert time.monotonic() < deadline, "the session cluster's warm driver does not listen"
        time.sleep(0.5)
    address = ray_cluster.get_runtime_context().gcs_address
    command = tmp_path / "command.yaml"
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", str(command), "--address", address],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"satp: error: {command}: job file not found"]
    log = (Path(record.temp_dir) / LOG_NAME).read_text()
    assert any(line.startswith("forked pid") and line.endswith(f": satp train {command} --address {address}")
               for line in log.splitlines()), log
    library = tmp_path / "library.yaml"
    assert main(["train", str(library), "--address", address]) == 2
    assert str(library) not in (Path(record.temp_dir) / LOG_NAME).read_text()


@pytest.mark.ray
@pytest.mark.slow
def test_ctrl_z_stops_the_forked_run_with_the_command_and_fg_continues_both(warm_driver, tiny_setting, tmp_path):
    import psutil

    base, address = tiny_setting
    job = tiny_subset_job(base, tmp_path, "wd-stop", epochs=3)
    command = _command(warm_driver, ["train", str(job), "--address", address, "--no-progress"], tmp_path)
    try:
        lease = tmp_path / "ray" / "wd-stop" / "satp-lease.json"
        deadline = time.monotonic() + 300
        while not lease.exists():  # the forked run holds its lease: it runs
            assert command.poll() is None and time.monotonic() < deadline, command.communicate()[1][-3000:]
            time.sleep(0.2)
        (forked,) = [p.pid for runner in psutil.Process(warm_driver["server"].pid).children() for p in runner.children()]
        command.send_signal(signal.SIGTSTP)
        deadline = time.monotonic() + 30
        while {process_state(command.pid), process_state(forked)} != {"T"} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (process_state(command.pid), process_state(forked)) == ("T", "T")
        command.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while "T" in (process_state(command.pid), process_state(forked)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "T" not in (process_state(command.pid), process_state(forked))
    finally:
        command.send_signal(signal.SIGCONT)  # whatever the assertions found stopped goes on, to its end
        command.send_signal(signal.SIGTERM)
        _, err = command.communicate(timeout=300)
    assert command.returncode == 143, err[-3000:]


def test_an_edited_checkout_runs_in_its_own_process_once_then_the_driver_imports_it_again(tmp_path):
    """satp's code edited under a running warm driver: the next command runs in its own process (one
    line says why), the driver starts over in its own process id (``exec``) importing the edited
    code, and the command after it is forked again."""
    import shutil

    checkout = tmp_path / "checkout"
    for package in ("pipeline", "sat", "runtime", "preprocessing"):
        shutil.copytree(ROOT / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
    socket_path, log = tmp_path / "wd.sock", tmp_path / "wd.log"
    # a shell's environment: importing Ray set RAY_CLIENT_MODE in this process's (and a driver started
    # over with the environment its imports had changed refused every command after it)
    env = {**os.environ, "SATP_TEST_FAULT": "", "PYTHONPATH": str(checkout)}
    env.pop("RAY_CLIENT_MODE", None)
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "pipeline.cli.warm_driver", "--socket", str(socket_path)],
                                  cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def listening(times: int) -> None:
            deadline = time.monotonic() + 300
            while log.read_text().count(f"warm driver pid {server.pid} on") < times or not socket_path.exists():
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)

        def command() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", CLIENT, str(socket_path), "train", "missing.yaml"], cwd=checkout,
                                  env=env, capture_output=True, text=True, timeout=120)

        listening(1)
        assert command().returncode == 2  # forked: the job file's error, from the forked command
        edited = checkout / "pipeline" / "cli" / "args.py"
        os.utime(edited, ns=(edited.stat().st_atime_ns, edited.stat().st_mtime_ns + 1))
        apart = command()
        assert apart.returncode == 99 and "satp's code changed since it started" in apart.stderr, apart.stderr
        listening(2)
        assert command().returncode == 2, log.read_text()[-3000:]
        assert [line.split()[0] for line in log.read_text().splitlines()
                if line.startswith(("forked", "refused"))] == ["forked", "refused:", "forked"], log.read_text()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
