"""Shared fixtures. Ray-based tests share one local cluster per session (see `ray_cluster`)."""
from __future__ import annotations

import hashlib
import os
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

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels (sat.edge_messages) run on CPU tensors only in its interpreter, which Triton
    # reads when it is first imported; with a GPU they compile and run on CUDA instead.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session, started in this process the way a user's
    command without ``satp cluster`` starts one (the default, cold path:
    :func:`runtime.ray_cluster.connect` without an address). The ``satp`` commands the tests run
    reach it through ``RAY_ADDRESS``, set here for the session."""
    import ray

    from runtime.ray_cluster import connect

    os.environ.pop("RAY_ADDRESS", None)
    if not ray.is_initialized():
        connect(None, num_cpus=2, log_to_driver=False)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    yield ray
    os.environ.pop("RAY_ADDRESS", None)
    ray.shutdown()


#: the modules ``--beside`` runs in a second pytest process, in this order (none uses the session's
#: cluster): first those that start Ray clusters of their own and wait on them half the time, then
#: some that compute in their own processes. A fresh clone's suite on 2 cores: 990 s of pytest in one
#: process, 745-765 s with these beside; six more of the kind did not shorten it (benchmarks/RESULTS.md)
BESIDE_MODULES = ("test_elastic.py", "test_node_loss.py", "test_submit.py", "test_edge_messages.py",
                  "test_global_batch.py", "test_compile.py")
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
    """``(folder, Ray address)``: the tiny ogbg-code2-format dataset of ``tests/test_train_ray.py`` (made
    once per session) and the session's cluster, for tests that run ``satp train`` commands on it."""
    from tests.test_train_ray import tiny_data

    base = tmp_path_factory.getbasetemp() / "satp-tiny"
    base.mkdir(exist_ok=True)
    tiny_data(base)
    return base, ray_cluster.get_runtime_context().gcs_address


def conversion_killed_in(dataset: str, key: str, batch_rows: int = 0) -> str:
    """Code for ``python -c CODE FOLDER``: build FOLDER's columnar store of ``dataset`` in 4 KiB blocks
    (``batch_rows``: rows per record batch, 0 keeps the default), SIGKILLed in the third block of
    the raw file converted into the store's ``key`` (a conversion interrupted mid-file)."""
    rows = f"conversion.BATCH_ROWS = {batch_rows}" if batch_rows else ""
    return f"""
import os, signal, sys
from preprocessing import columnar, conversion
conversion.BLOCK_BYTES = 1 << 12
{rows}
parse, blocks = conversion._parse, []

def dies_mid_file(block, spec, path):
    if spec.key == {key!r}:
        blocks.append(1)
        if len(blocks) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    return parse(block, spec, path)

conversion._parse = dies_mid_file
folder = sys.argv[1]
conversion.build_store(folder, {dataset!r}, columnar.raw_fingerprint(folder, {dataset!r}))
"""


def kept_for_backward(fn) -> list[torch.Tensor]:
    """The distinct tensors (one per storage and dtype) autograd keeps for the backward pass while ``fn`` runs."""
    seen = {}

    def pack(t):
        seen.setdefault((t.untyped_storage().data_ptr(), t.dtype), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(seen.values())


def parent_and_children(tracking_uri: str, experiment: str, kind: str, parent_run_id: str):
    """The one FINISHED parent run of a sweep or comparison (``satp.kind``) and its child runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("satp.kind") == kind]
    assert len(parents) == 1 and parents[0].info.run_id == parent_run_id
    assert parents[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_run_id]
    return client, parents[0], children


def run_one_rank(argv: list[str], env: dict, timeout: float, **kwargs):
    """``subprocess.run`` of a one-process torch.distributed job on a free ``MASTER_PORT``, again on
    another one where the port was taken between the look and the job's bind (``EADDRINUSE``: the
    session's Ray processes and commands open ports all the while)."""
    import socket
    import subprocess

    for _attempt in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run(argv, env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              capture_output=True, text=True, timeout=timeout, **kwargs)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    return proc
