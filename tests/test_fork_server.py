"""The fork server (runtime/fork_server.py): a Ray worker and a satp command forked from a process that
imported the heavy stack once; both ends refuse a peer of another user; a client gone before it read
the reply takes its forked process with it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from runtime import fork_server

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 65534  # nobody
SYSTEM_PYTHON = "/usr/bin/python3"
AS_ROOT_ONLY = pytest.mark.skipif(
    os.getuid() != 0 or not Path(SYSTEM_PYTHON).exists(),
    reason="needs a second local user: run as root (the other side runs as uid 65534 with /usr/bin/python3)")


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (reaped, or a zombie waiting for its parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(until, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (found := until()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return found


def _forked_pid(log: Path, argv: str):
    """The pid the server's log says it forked for the request ``argv`` (None: none yet)."""
    for line in log.read_text().splitlines():
        if line.startswith("forked pid ") and line.endswith(f": {argv}"):
            return int(line.split()[2])
    return None


@pytest.fixture(scope="module")
def server():
    folder = Path(tempfile.mkdtemp(prefix="satpf", dir="/tmp"))  # 0700, as a satp cluster's
    path, log = folder / fork_server.SOCKET_NAME, folder / fork_server.LOG_NAME
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    env.pop("PYTEST_CURRENT_TEST", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime.fork_server", "--serve", str(path)], env=env, cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert fork_server.wait_ready(str(path), 180), log.read_text()
        yield {"path": path, "log": log, "env": env, "folder": folder, "proc": proc}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        subprocess.run(["rm", "-rf", str(folder)])


def test_the_socket_is_its_owner_s_only(server):
    assert server["path"].stat().st_mode & 0o777 == 0o600
    assert server["folder"].stat().st_mode & 0o777 == 0o700


def test_a_worker_is_forked_with_the_client_s_argv_folder_streams_and_status(server, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, torch\n"
                      "print('pid', os.getpid(), 'args', sys.argv[1:], 'cwd', os.getcwd(), 'torch' in sys.modules)\n"
                      "print('err line', file=sys.stderr)\n"
                      "sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-m", "runtime.fork_server", "--worker", str(server["path"]), str(script),
                           "a", "b"], env=server["env"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    words = done.stdout.split()
    assert words[2:] == ["args", "['a',", "'b']", "cwd", str(tmp_path), "True"], done.stdout
    assert "err line" in done.stderr
    forked = int(words[1])
    lines = server["log"].read_text()
    assert f"forked pid {forked} for client pid" in lines and str(script) in lines


def test_a_command_is_forked_and_says_its_error_on_the_client_s_stderr(server, tmp_path):
    code = f"import sys; from runtime import fork_server as f; sys.exit(f.run_command({str(server['path'])!r}, " \
           "['train', 'missing.yaml'], print))"
    done = subprocess.run([sys.executable, "-c", code], env=server["env"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "satp: error:" in done.stderr and "missing.yaml" in done.stderr
    assert "train missing.yaml" in server["log"].read_text()


def test_a_client_with_other_import_time_settings_is_refused(server, tmp_path):
    env = dict(server["env"], DS_ACCELERATOR="cuda")  # DeepSpeed read it when the server imported it
    code = f"import sys; from runtime import fork_server as f; print(f.run_command({str(server['path'])!r}, " \
           "['train', 'missing.yaml'], print))"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert "did not run this command (another DS_ACCELERATOR in the environment)" in done.stdout
    assert done.stdout.strip().endswith("None")


def test_a_client_gone_before_it_read_the_reply_takes_its_process_along(server, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    # the request and streams sent, then the client dies at once, before reading the reply
    code = textwrap.dedent(f"""
        import json, os, socket
        from runtime import fork_server as f
        conn = f._connect({str(server['path'])!r})
        message = f._message("worker", [{str(script)!r}], [])
        socket.send_fds(conn, [json.dumps(message).encode() + b"\\n"], [0, 1, 2])
        os._exit(0)
        """)
    client = subprocess.run([sys.executable, "-c", code], env=server["env"], cwd=tmp_path, timeout=120,
                            stdin=subprocess.DEVNULL, capture_output=True)
    assert client.returncode == 0, client.stderr
    forked = _wait(lambda: _forked_pid(server["log"], str(script)), "the fork's log line")
    # the server logs the kill after it reaped the process: wait for the line, then the process is gone
    _wait(lambda: f"killed pid {forked}: its client went first" in server["log"].read_text(),
          f"the forked process {forked} to be killed with its client", timeout=30)
    assert _gone(forked)


# ----------------------------------------------------------------------------- another user
@AS_ROOT_ONLY
def test_the_server_refuses_a_client_of_another_user(server, tmp_path):
    # the cluster's 0700 folder and the 0600 socket keep other users out; opened here, to test the check behind them
    reachable = server["path"]
    server["folder"].chmod(0o711)
    server["path"].chmod(0o666)
    try:
        code = textwrap.dedent(f"""
            import socket
            conn = socket.socket(socket.AF_UNIX)
            conn.connect({str(reachable)!r})
            try:
                conn.sendall(b'{{"kind": "ping"}}\\n')
                print(repr(conn.recv(100)))
            except ConnectionResetError:  # closed unread
                print("b''")
            """)
        done = subprocess.run([SYSTEM_PYTHON, "-c", code], user=OTHER_UID, group=OTHER_UID, cwd="/",
                              capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    finally:
        server["path"].chmod(0o600)
        server["folder"].chmod(0o700)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "b''"  # no answer: the connection closed unread
    assert f"refused a client of user id {OTHER_UID}" in server["log"].read_text()


@pytest.fixture
def other_users_listener():
    """Another user's listener at a fork server's path (in a folder every user may enter): yields the
    path and what it received, read once the client has closed its connection."""
    shared = Path(tempfile.mkdtemp(prefix="satpo", dir="/tmp"))
    shared.chmod(0o777)
    path, got = shared / "fork.sock", shared / "received"
    # it records what it receives, and says it listens
    code = textwrap.dedent(f"""
        import os, socket
        listener = socket.socket(socket.AF_UNIX)
        listener.bind({str(path)!r})
        os.chmod({str(path)!r}, 0o777)
        listener.listen(1)
        open({str(shared / 'ready')!r}, 'w').close()
        conn, _ = listener.accept()
        conn.settimeout(10)
        data = b''
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except OSError:
            pass
        open({str(got)!r}, 'wb').write(data)
        """)
    other = subprocess.Popen([SYSTEM_PYTHON, "-c", code], user=OTHER_UID, group=OTHER_UID, cwd="/",
                             env={"PATH": "/usr/bin:/bin"})
    try:
        _wait(lambda: (shared / "ready").exists() or other.poll() is not None, "the other user's listener", 30)
        assert other.poll() is None

        def received() -> bytes:
            other.wait(timeout=30)
            return got.read_bytes()

        yield path, received
    finally:
        if other.poll() is None:
            other.kill()
        subprocess.run(["rm", "-rf", str(shared)])


@AS_ROOT_ONLY
def test_a_client_sends_nothing_to_a_server_of_another_user(other_users_listener):
    path, received = other_users_listener
    warned = []
    env_secret = "SECRET_TOKEN"
    os.environ[env_secret] = "s3cr3t"
    try:
        assert fork_server.run_command(str(path), ["train", "job.yaml"], warned.append) is None
    finally:
        os.environ.pop(env_secret)
    assert received() == b""
    assert len(warned) == 1 and f"belongs to user id {OTHER_UID}" in warned[0] and "nothing sent" in warned[0]
    assert str(path) in warned[0]


@AS_ROOT_ONLY
def test_a_worker_sends_nothing_to_a_server_of_another_user_and_runs_in_its_own_process(other_users_listener,
                                                                                          tmp_path):
    path, received = other_users_listener
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\nprint('pid', os.getpid(), 'args', sys.argv[1:])\nsys.exit(3)\n")
    client = subprocess.Popen([sys.executable, "-m", "runtime.fork_server", "--worker", str(path), str(script), "a"],
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    out, err = client.communicate(timeout=120)
    assert client.returncode == 3, err  # Ray's worker ran, as Ray would have run it: in the client's own process
    assert out.split() == ["pid", str(client.pid), "args", "['a']"]
    assert received() == b""
    assert err.strip().splitlines() == [f"satp: warning: {path} belongs to user id {OTHER_UID}, not to this user "
                                        f"({os.getuid()}); nothing sent; the worker runs in its own process"]
