"""The warm driver (``pipeline/cli/warm_driver.py``): ``satp train`` forked from a process that imported
satp's driver. One real warm driver process for the module; the command's side is
:func:`pipeline.cli.warm_driver.run_command` in a process of its own (what ``satp train`` calls on a satp
cluster started with ``--warm-driver``)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_interrupts import _job, _running

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
    """``(command, its stderr)``: the tiny job (3 epochs) on the session cluster, forked by the warm
    driver; after epoch 0's checkpoint the run sends ``signal_name`` to the command's process."""
    base, address = tiny_setting
    job = _job(base, tmp_path, run_name, epochs=3)
    fault = {"signal": signal_name, "epoch": 0, "marker": str(tmp_path / "fired")}
    command = _command(warm_driver, ["train", str(job), "--address", address, "--no-progress"], tmp_path, fault)
    _, err = command.communicate(timeout=600)
    return command, err


def _forked(warm_driver) -> list[int]:
    """The warm driver's descendants: a runner and its command per command under way."""
    import psutil

    return [p.pid for p in psutil.Process(warm_driver["server"].pid).children(recursive=True)]


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
    assert difference(mine, dict(mine, code="edited")) == "satp's code changed since it started"


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
    stopped, err = _signalled_run(warm_driver, tiny_setting, tmp_path, "wd-term", "SIGTERM")
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
    killed, err = _signalled_run(warm_driver, tiny_setting, tmp_path, "wd-kill", "SIGKILL")
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    # the run's lease names the process that ran it: the forked command, SIGKILLed by its runner
    holder = json.loads((tmp_path / "ray" / "wd-kill" / "satp-lease.json").read_text())["pid"]
    assert holder != killed.pid
    deadline = time.monotonic() + 30
    while (_running(holder) or _forked(warm_driver)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _running(holder) and not _forked(warm_driver)
