"""The worker fork server (``runtime/forked_workers.py``): Ray's worker processes forked from a process
that imported torch, PyG and DeepSpeed. One real server for the module; its client runs a small script
in place of Ray's ``default_worker.py`` (the Ray worker itself: the runs on the session cluster, whose
start-up lines say "forked worker process", tests/test_warm_cluster.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import forked_workers, forking
from tests.helpers import is_running

ROOT = Path(__file__).resolve().parents[1]
#: stands for Ray's default_worker.py: says what it was given and what its process holds, then
#: sleeps when asked to (a signal's target) and ends with the status it was given
SCRIPT = """
import json, os, sys, time
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "argv": sys.argv,
                  "cwd": os.getcwd(), "path0": sys.path[0], "marker": os.environ.get("MARKER"),
                  "torch_imported": "torch" in sys.modules, "ray_imported": "ray" in sys.modules,
                  "forked_from": os.environ.get("SATP_FORKED_FROM")}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("worker-fork")
    path, log = folder / forked_workers.SOCKET_NAME, folder / forked_workers.LOG_NAME
    script = folder / "worker" / "default_worker.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "runtime.forked_workers", "--serve", str(path)], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while not path.exists():
        assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)
    yield path, log, script, env
    server.terminate()
    server.wait(timeout=30)


def _client(fork_server, *args: str, sock=None, **env: str) -> subprocess.Popen:
    path, _, script, base = fork_server
    return subprocess.Popen([sys.executable, "-m", "runtime.forked_workers", "--client", str(sock or path),
                             str(script), *args], env={**base, "MARKER": "m1", **env}, cwd=str(script.parent.parent),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_identities_differ_by_interpreter_or_import_time_variables():
    mine = forked_workers.identity({"DS_ACCELERATOR": "cpu", "RAY_JOB_ID": "01000000", "HOME": "/root"})
    assert mine["env"] == {"DS_ACCELERATOR": "cpu"}  # Ray's and the rest are the worker's own, read later
    assert forking.difference(mine, forked_workers.identity({"DS_ACCELERATOR": "cpu", "HOME": "/x"})) is None
    theirs = forked_workers.identity({"DS_ACCELERATOR": "cuda", "OMP_NUM_THREADS": "1"})
    assert forking.difference(mine, theirs) == "another DS_ACCELERATOR, OMP_NUM_THREADS in the environment"
    assert forking.difference(mine, dict(mine, python="/other/python")) == "another interpreter (/other/python)"
    assert forked_workers.executable("/tmp/s.sock").split() == [sys.executable, "-m", "runtime.forked_workers",
                                                                "--client", "/tmp/s.sock"]


def test_a_worker_is_forked_with_the_clients_arguments_environment_and_status(fork_server):
    _, log, script, _ = fork_server
    proc = _client(fork_server, "run", "3")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err[-2000:]
    seen = json.loads(out)
    assert seen["torch_imported"] and not seen["ray_imported"]  # the server's imports, never Ray's
    assert seen["argv"] == [str(script), "run", "3"] and seen["marker"] == "m1"
    assert seen["cwd"] == str(script.parent.parent) and seen["path0"] == str(script.parent)  # as `python script`
    assert seen["pgid"] == seen["pid"]  # its own group, as the raylet gives its workers (it ends it with them)
    assert seen["ppid"] != proc.pid and float(seen["forked_from"]) < time.time()
    assert f"forked worker pid {seen['pid']} for client pid {proc.pid}" in log.read_text().splitlines()
    assert forked_workers.forked_pids(log)[proc.pid] == seen["pid"]  # the client's worker, read from the log


def test_a_signal_to_the_client_ends_the_worker_and_a_killed_client_takes_it_along(fork_server):
    for signum in (signal.SIGTERM, signal.SIGKILL):
        proc = _client(fork_server, "sleep", "0")
        seen = json.loads(proc.stdout.readline())
        proc.send_signal(signum)
        proc.communicate(timeout=60)
        assert proc.returncode == -signum
        deadline = time.monotonic() + 30  # SIGTERM: forwarded; SIGKILL: the runner sees the client gone
        while is_running(seen["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_running(seen["pid"]), f"worker {seen['pid']} outlived its client ({signum})"


def test_a_client_gone_before_it_read_the_reply_takes_its_worker_along(fork_server):
    """A client killed while its worker started (the runner's reply never read: the runner's write or
    read of the socket fails) still takes the worker along, instead of leaving it running, holding
    the client's standard streams (seen once: a suite's `communicate` waited on them for 60 s)."""
    import socket

    path, _, script, base = fork_server
    out_read, out_write = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(path))
    env = {**base, "MARKER": "m1"}
    request = {"argv": [str(script), "sleep", "0"], "cwd": str(script.parent.parent), "env": env,
               "path": [str(script.parent), *sys.path[1:]], "identity": forked_workers.identity(env), "client": os.getpid()}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, out_write, 2])
    os.close(out_write)
    conn.close()  # gone at once, the reply unread
    # the stream ends when its last writer, the worker (it sleeps 120 s if left), has ended
    import select

    text, deadline = b"", time.monotonic() + 30
    while time.monotonic() < deadline:
        if select.select([out_read], [], [], 0.5)[0]:
            chunk = os.read(out_read, 1 << 16)
            if not chunk:
                break
            text += chunk
    else:
        pytest.fail(f"the worker outlived its client: {text!r}")
    os.close(out_read)
    for line in text.decode().splitlines():  # it may have started before the kill
        assert not is_running(json.loads(line)["pid"])


def test_a_worker_of_another_environment_or_without_a_server_starts_as_ray_starts_it(fork_server, tmp_path):
    _, log, _, _ = fork_server
    for proc in (_client(fork_server, "run", "4", DS_ACCELERATOR="cuda"),
                 _client(fork_server, "run", "4", sock=tmp_path / "none.sock")):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 4, err[-2000:]
        seen = json.loads(out)
        assert seen["pid"] == proc.pid and not seen["torch_imported"] and seen["forked_from"] is None
    assert "refused (another DS_ACCELERATOR in the environment): a worker started by the raylet instead" in \
        log.read_text().splitlines()
