"""Shared fixtures. Ray-based tests share one local cluster per session (see `ray_cluster`)."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OUTDATED_IGNORE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# the session's cluster (see ray_cluster) takes Ray's default token authentication, which a client
# process reads when it first imports Ray: before any test module does
os.environ.setdefault("RAY_AUTH_MODE", "token")


def satp_home_for_tests() -> Path:
    """``SATP_HOME`` of this checkout's test sessions: never the user's own ``~/.satp``, so that a satp
    cluster the user runs is not what the tests' commands use (the warm path has tests of its own:
    tests/test_local_cluster.py, tests/test_fork_server.py)."""
    root = Path(__file__).resolve().parents[1]
    return Path(tempfile.gettempdir()) / f"satp-tests-{hashlib.sha1(str(root).encode()).hexdigest()[:10]}"


os.environ["SATP_HOME"] = str(satp_home_for_tests())
from runtime.command import set_command_environment  # noqa: E402

set_command_environment()  # as a satp command: a local Ray on loopback (Ray reads it when first imported)

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels (sat.edge_messages) run on CPU tensors only in its interpreter, which Triton
    # reads when it is first imported; with a GPU they compile and run on CUDA instead.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster for the whole test session, started in this process the way a user's
    command without ``satp cluster`` starts one (:func:`runtime.ray_cluster.connect` without an
    address). The ``satp`` commands the tests run reach it through ``RAY_ADDRESS``, set here for the
    session; each starts cold, in its own interpreter, as a user's command on a cluster satp did not
    start does. Their Ray workers are forked by a fork server that ``SATP_FORK_SOCKET`` names, as
    docs/scale.md sets one up for such a cluster: a worker that imported torch, PyG and DeepSpeed
    again for each of the session's few hundred runs made most of the suite's time."""
    import ray

    from runtime import fork_server
    from runtime.ray_cluster import connect

    folder = tempfile.mkdtemp(prefix="satpf", dir="/tmp")  # short: a socket's path must fit 107 bytes
    socket_path = str(Path(folder) / fork_server.SOCKET_NAME)
    os.environ.pop("RAY_ADDRESS", None)
    with open(tmp_path_factory.getbasetemp() / fork_server.LOG_NAME, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "runtime.fork_server", "--serve", socket_path],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    os.environ[fork_server.SOCKET_VAR] = socket_path
    if not ray.is_initialized():
        connect(None, num_cpus=2, log_to_driver=False)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    yield ray
    os.environ.pop(fork_server.SOCKET_VAR, None)
    os.environ.pop("RAY_ADDRESS", None)
    ray.shutdown()
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)


#: the modules ``--beside`` runs in a second pytest process, in this order (none uses the session's
#: cluster): first those that start Ray clusters of their own and wait on them half the time, then
#: some that compute in their own processes. On 2 cores the two processes keep both busy (97-100%):
#: moving three modules of the session's cluster beside, on a second cluster of that process's own,
#: took the two from 1,738 s / 807 s to 1,687 s / 1,536 s, no shorter in all (benchmarks/RESULTS.md)
BESIDE_MODULES = ("test_elastic.py", "test_node_loss.py", "test_store_nodes.py", "test_submit.py",
                  "test_edge_messages.py", "test_global_batch.py", "test_compile.py")
#: the process running them, its output file and its test count
BESIDE = pytest.StashKey[tuple]()


def pytest_addoption(parser):
    parser.addoption(
        "--beside", action="store_true",
        help="run the selected tests of tests/conftest.py's BESIDE_MODULES in a second pytest process beside this "
             "one (its failures fail the session; tests marked quiet wait until it has ended)")


def pytest_collection_modifyitems(config, items):
    """With ``--beside``, the tests of :data:`BESIDE_MODULES` leave this session for a second pytest
    process, started now with half the CPUs' torch threads (two processes' threads spinning on each
    other's cores cost CPU)."""
    if not config.getoption("beside") or config.option.collectonly:
        return
    order = {name: i for i, name in enumerate(BESIDE_MODULES)}
    beside = sorted((item for item in items if item.path.name in order), key=lambda item: order[item.path.name])
    shared = sorted({item.path.name for item in beside if "ray_cluster" in item.fixturenames})
    if shared:  # two sessions on the session's cluster would each take it for theirs
        raise pytest.UsageError(f"--beside: {', '.join(shared)}: tests that use the session's Ray cluster "
                                "(ray_cluster); only modules that start clusters of their own can run beside")
    if not beside:
        return
    items[:] = [item for item in items if item.path.name not in order]
    config.hook.pytest_deselected(items=beside)
    output = config._tmp_path_factory.getbasetemp() / "beside.log"
    durations = config.getoption("durations")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               *([f"--durations={durations}"] if durations is not None else []), *(item.nodeid for item in beside)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    with output.open("w") as out:
        process = subprocess.Popen(command, cwd=config.rootpath, env=env, stdout=out, stderr=subprocess.STDOUT)
    config.stash[BESIDE] = (process, output, len(beside))


def pytest_runtest_setup(item):
    """A test marked ``quiet`` waits for what happens on idle CPUs only (the warm pool's refill): it
    starts once the ``--beside`` process has ended."""
    if item.get_closest_marker("quiet") and BESIDE in item.config.stash:
        item.config.stash[BESIDE][0].wait()


def pytest_sessionfinish(session, exitstatus):
    """The session fails when the ``--beside`` process failed (interrupted, it stops that one too)."""
    if BESIDE not in session.config.stash:
        return
    process = session.config.stash[BESIDE][0]
    if exitstatus == pytest.ExitCode.INTERRUPTED and process.poll() is None:
        process.send_signal(signal.SIGINT)
    if process.wait() != 0 and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _ray_state() -> str:
    """What the session's cluster holds: its free resources, live placement groups and actors."""
    import ray
    from ray._private import state

    if not ray.is_initialized():
        return "this process is not connected to a Ray cluster"
    lines = [f"free {ray.available_resources()} of {ray.cluster_resources()}"]
    lines += [f"placement group {pg_id[:8]} {pg['state']} {pg['bundles']} (job {pg.get('creator_job_id')})"
              for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]
    lines += [f"actor {info['ActorClassName']} {info['State']} pid {info.get('Pid')} job {info['JobID']}"
              for info in state.actors().values() if info["State"] != "DEAD"]
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test stopped by pytest-timeout (``timeout`` in pyproject.toml) also reports what the session's
    Ray cluster held then: a run waiting for resources another test left taken says so."""
    report = (yield).get_result()
    if report.failed and "from pytest-timeout" in str(report.longrepr):
        try:
            report.sections.append(("Ray cluster at the timeout", _ray_state()))
        except Exception as exc:  # the report matters more than this addition to it
            report.sections.append(("Ray cluster at the timeout", f"unreadable: {exc!r}"))


def pytest_terminal_summary(terminalreporter, config):
    """The ``--beside`` process's outcome (its whole output when it failed)."""
    if BESIDE in config.stash:
        process, output, count = config.stash[BESIDE]
        text = output.read_text()
        last = text.strip().splitlines()[-1] if text.strip() else "(no output)"
        terminalreporter.section(f"the tests beside the session (--beside): {count}, exit {process.returncode}")
        if process.returncode != 0:
            terminalreporter.write(text)
        terminalreporter.write_line(f"{last} (output: {output})")


@pytest.fixture(scope="module")
def tiny_setting(ray_cluster, tmp_path_factory):
    """``(folder, Ray address)``: the tiny ogbg-code2-format dataset (:func:`tests.helpers.tiny_data`, made
    once per session) and the session's cluster, for tests that run ``satp train`` commands on it."""
    from tests.helpers import tiny_data

    base = tmp_path_factory.getbasetemp() / "satp-tiny"
    base.mkdir(exist_ok=True)
    tiny_data(base)
    return base, ray_cluster.get_runtime_context().gcs_address


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of its own (tmpfs), to be filled: ``mount(size)`` mounts it (root only:
    the test skips where mounting is not permitted), ``fill(leave)`` fills it up to ``leave`` bytes free."""
    mounts = []

    class Disk:
        path = tmp_path / "disk"

        def mount(self, size: str) -> Path:
            self.path.mkdir(exist_ok=True)
            try:
                done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)],
                                      capture_output=True, text=True, timeout=60)
                problem = done.stderr.strip() or f"status {done.returncode}" if done.returncode != 0 else None
            except (OSError, subprocess.TimeoutExpired) as exc:
                problem = str(exc)
            if problem is not None:
                pytest.skip(f"a tmpfs cannot be mounted here ({problem}): a real full disk needs root (or "
                            "CAP_SYS_ADMIN) and mount")
            mounts.append(self.path)
            return self.path

        def fill(self, leave: int = 0) -> Path:
            filler = self.path / "filler"
            free = os.statvfs(self.path).f_bavail * os.statvfs(self.path).f_frsize
            with open(filler, "ab") as f:
                f.write(b"\0" * max(0, free - leave))
            return filler

    yield Disk()
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
