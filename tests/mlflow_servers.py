"""Real MLflow server processes for tests, on 127.0.0.1 at a free port: ``mlflow server`` (a tracking
server) and ``mlflow models serve`` (a model's scoring server), started with this interpreter's
MLflow, waited for until they answer, and stopped by their process id."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: how long a server may take to answer: imports and the model load, on a busy 2-core machine
START_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``mlflow ARGS --host 127.0.0.1 --port PORT`` (:func:`launch`), once it answers (:func:`wait`)."""
    proc, url = launch(args, log, env)
    wait(proc, url, log)
    return proc, url


def launch(args: list[str], log: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``mlflow ARGS --host 127.0.0.1 --port PORT`` in its own process group, its output to ``log``;
    returns the process and its URL at once (servers started together start in parallel)."""
    port = free_port()
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                   **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", *args, "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=environment, cwd=ROOT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Until the server at ``url`` answers ``/health`` (its log shown when it never does)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5).close()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"mlflow {proc.args[3]} did not answer at {url} within {START_S} s:\n{log.read_text()[-3000:]}")


def cpu_seconds(proc: subprocess.Popen) -> float:
    """CPU time (user + system) of the processes in ``proc``'s process group, now."""
    total = 0
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[2]) == proc.pid:  # the process group
            total += int(fields[11]) + int(fields[12])
    return total / tick


def stop(proc: subprocess.Popen) -> None:
    """End the server and the workers it started (its process group, by the group's id)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
