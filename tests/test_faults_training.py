"""Faults at the training run's writes: checkpoints, the run lease, the MLflow run and
the model registration, each under {killed mid-write (SIGKILL), cut short or bit-flipped
afterwards, a full disk, a second writer at the same time}.

What every case asserts: the next command detects the fault, names the file in one ``satp:``
line, goes on from the newest intact state, and loses nothing that was intact. Most cases work
on real files and real processes at the level of the function that writes or reads (seconds);
a few run the real ``satp train`` command on the tiny dataset of ``tests.helpers``, against
the session's Ray cluster (``--address``), except the double Ctrl-C, which needs the command's
own local cluster to see it torn down. docs/faults.md lists the matrix.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import (SESSION_CLUSTER_VARS, Drain, checkpoint_epochs, checkpoint_part, fault_job, process_state,
                           run_satp_train, satp_env, satp_lines, tiny_job_dict, tracebacks, train_command, wait_until)

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- helpers
def _stop(command: subprocess.Popen) -> None:
    """Stop a running ``satp`` command as Ctrl-Z does (``SIGTSTP``): a command forked by the session
    cluster's warm driver stops with its process (whose handler stops both); one in its own process
    whose process group is orphaned (no shell's job, as under make or CI) discards the signal, and
    gets ``SIGSTOP`` instead."""
    command.send_signal(signal.SIGTSTP)
    deadline = time.monotonic() + 10
    while process_state(command.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_state(command.pid) != "T":
        command.send_signal(signal.SIGSTOP)


# ============================================================================= checkpoints
def _write_checkpoint(run_dir: Path, epoch: int, tmp: Path) -> Path:
    """A checkpoint written into ``run_dir`` by satp's own writer (:meth:`pipeline.train.checkpoint.CheckpointManager.write`)."""
    from pipeline.train.checkpoint import CheckpointManager

    name = CheckpointManager(run_dir).write(checkpoint_part(tmp / f"local-{epoch}", epoch), rank=0, epoch=epoch)
    time.sleep(0.01)  # names are timestamps to the microsecond
    return run_dir / name


PERSIST = r'''
import sys
from pipeline.train.checkpoint import CheckpointManager
CheckpointManager(sys.argv[2]).write(sys.argv[1], rank=0, epoch=int(sys.argv[3]))
'''


def test_checkpoint_killed_mid_write_is_named_and_never_resumed_from(tmp_path, capfd):
    """C x SIGKILL: satp's writer killed while it copies the model states (its source never ends,
    so the kill lands mid-file). The next command names the part never completed, resumes from
    the checkpoint before, and deletes the partial one (Ray never registered it)."""
    from pipeline.train.checkpoint import SNAPSHOT, CheckpointManager

    run_dir = tmp_path / "run"
    intact = _write_checkpoint(run_dir, 0, tmp_path)
    (run_dir / SNAPSHOT).write_text(json.dumps({"checkpoint_results": [{"checkpoint_dir_name": intact.name}]}))
    endless = checkpoint_part(tmp_path / "local-1", 1, {"ds/last/mp_rank_00_model_states.pt": Path("/dev/zero")})
    writer = subprocess.Popen([sys.executable, "-c", PERSIST, str(endless), str(run_dir), "1"], cwd=ROOT)
    partial = lambda: [p for p in run_dir.glob("checkpoint_*/ds/last/mp_rank_00_model_states.pt")  # noqa: E731
                       if p.stat().st_size > 1 << 20]
    wait_until(partial, "a model-states file half written", timeout=120, proc=writer)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    (cut,) = [p.parents[2] for p in partial()]
    capfd.readouterr()
    manager = CheckpointManager(run_dir)
    assert manager.newest_intact() == intact.name
    (line,) = satp_lines(capfd.readouterr().err)
    assert line.startswith(f"satp: warning: {cut / 'rank_0.json'}: missing (rank 0's part was never completely "
                           "written); checkpoint"), line
    assert f"(epoch 1) is damaged and not resumed from; the run goes on from {intact.name} (epoch 0)" in line
    assert manager.prune(keep=intact.name) == [cut.name]
    assert manager.verify(intact.name) is None


@pytest.mark.parametrize("damage", ["cut short", "bit flipped"])
def test_checkpoint_damaged_afterwards_is_named_and_the_one_before_used(tmp_path, capfd, damage):
    """C x truncation / bit flip: the newest checkpoint (registered by Ray, its latest) damaged after
    it was written. The driver's choice and the workers' (Ray's registered one first) both name the
    file and take the checkpoint before; nothing intact is touched."""
    from pipeline.train.checkpoint import CheckpointManager
    from pipeline.train.rerun import previous_run

    run_dir = tmp_path / "run"
    older = _write_checkpoint(run_dir, 0, tmp_path)
    newest = _write_checkpoint(run_dir, 1, tmp_path)
    target = newest / "ds" / "last" / "mp_rank_00_model_states.pt"
    if damage == "cut short":
        os.truncate(target, 1000)
    else:
        with open(target, "r+b") as f:
            f.seek(150_000)
            byte = f.read(1)
            f.seek(150_000)
            f.write(bytes([byte[0] ^ 0x01]))
    capfd.readouterr()
    manager = CheckpointManager(run_dir)
    assert manager.newest_intact() == older.name
    assert manager.newest_intact([newest.name]) == older.name  # a worker handed Ray's registered one
    (line,) = satp_lines(capfd.readouterr().err)  # named once, however often it is looked at
    expected = "1000 bytes where 300000 were written (cut short)" if damage == "cut short" else "sha256 mismatch"
    assert line.startswith(f"satp: warning: {target}: ") and expected in line, line
    assert manager.verify(older.name) is None and previous_run(manager).epoch == 0


WORKER_RESUME = r'''
import json, sys
from pathlib import Path
from pipeline.train.checkpoint import CheckpointManager
print(CheckpointManager(sys.argv[2], damaged=json.loads(sys.argv[3])).newest_intact([Path(sys.argv[1]).name]))
'''


def test_a_damaged_checkpoint_the_driver_named_is_not_named_again_by_the_workers(tmp_path, capfd):
    """the driver names the damaged checkpoint; Ray's worker (another process) that is
    handed it as Ray's registered one takes the one before without saying it again (it said it twice)."""
    from pipeline.train.checkpoint import CheckpointManager

    run_dir = tmp_path / "run"
    older = _write_checkpoint(run_dir, 0, tmp_path)
    newest = _write_checkpoint(run_dir, 1, tmp_path)
    os.truncate(newest / "ds" / "last" / "mp_rank_00_model_states.pt", 1000)
    capfd.readouterr()
    driver = CheckpointManager(run_dir)
    assert driver.newest_intact() == older.name  # the driver
    assert len(satp_lines(capfd.readouterr().err)) == 1
    named = {problem: where for problem, where in driver.damaged.items() if str(newest) in problem}
    assert list(named.values()) == [f"the checkpoint of epoch 1 ({newest.name})"], named
    for told, lines in ((named, 0), ({}, 1)):  # a worker told what the driver named; one told nothing
        worker = subprocess.run([sys.executable, "-c", WORKER_RESUME, str(newest), str(run_dir), json.dumps(told)],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert worker.returncode == 0 and worker.stdout.strip() == older.name, worker.stderr[-2000:]
        assert len(satp_lines(worker.stderr)) == lines, worker.stderr


def test_checkpoint_on_a_full_disk_is_removed_and_the_intact_ones_kept(tmp_path, small_disk):
    """C x full disk (a real tmpfs): the writer raises :class:`StorageFull` naming the file that did
    not fit, having removed its partial checkpoint; the checkpoint before stays intact."""
    from pipeline.train import checkpoint as ckpt

    run_dir = small_disk.mount("2m") / "run"
    intact = _write_checkpoint(run_dir, 0, tmp_path)
    small_disk.fill(leave=100_000)
    with pytest.raises(ckpt.StorageFull) as full:
        _write_checkpoint(run_dir, 1, tmp_path)
    assert full.value.details["path"].startswith(str(run_dir / "checkpoint_")), full.value.details
    assert full.value.details["epoch"] == 1
    assert sorted(p.name for p in run_dir.iterdir()) == [intact.name]
    manager = ckpt.CheckpointManager(run_dir)
    assert manager.verify(intact.name) is None and manager.newest_intact() == intact.name


# ============================================================================= the run lease
HOLD = r'''
import sys, time
from pipeline.train.lease import RunLease
held = RunLease(sys.argv[1], "run", command="holder").acquire()
print("held", flush=True)
time.sleep(600)
'''


def test_lease_holder_killed_is_named_and_taken_over(tmp_path, capfd):
    """L x SIGKILL: the command holding the run's lease killed. While it lived, a second command was
    refused in one line naming it (host, pid, since when); once it is dead, the next command takes
    the lease over, naming the dead holder, and sweeps what a writer killed mid-write left beside it."""
    import socket

    from pipeline.train import lease

    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(lease.LeaseHeld) as refused:
            lease.RunLease(run_dir, "run").acquire()
        assert str(refused.value).startswith(f"{run_dir / lease.LEASE_FILE}: run 'run' is held by holder on host "
                                             f"{socket.gethostname()}, pid {holder.pid}, since "), refused.value
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    left = run_dir / f".{lease.LEASE_FILE}.0123.tmp"  # a record a killed writer never linked
    left.write_bytes(b'{"host": ')
    old = time.time() - lease.EXPIRES_S - 10
    os.utime(left, (old, old))
    capfd.readouterr()
    with lease.RunLease(run_dir, "run") as mine:
        assert mine.holder.pid == os.getpid()
    (line,) = satp_lines(capfd.readouterr().err)
    assert line.startswith(f"satp: warning: {run_dir / lease.LEASE_FILE}: the lease of run 'run' held by holder on host "), line
    assert f"pid {holder.pid}" in line and "its process is no longer running" in line, line
    assert list(run_dir.iterdir()) == []


def test_lease_damaged_is_refused_while_fresh_and_taken_over_once_stale(tmp_path, capfd):
    """L x truncation / bit flip: a lease that cannot be read (its checksum fails) holds while its
    file is fresh (a live holder rewrites it within a heartbeat) and is taken over once it is older
    than the expiry, each time named in one line."""
    from pipeline.train import lease

    run_dir = tmp_path / "run"
    with lease.RunLease(run_dir, "run"):
        data = (run_dir / lease.LEASE_FILE).read_bytes()
    path = run_dir / lease.LEASE_FILE
    for damaged in (data[: len(data) // 2], data.replace(b'"pid":', b'"pad":')):
        path.write_bytes(damaged)
        with pytest.raises(lease.LeaseHeld) as held:
            lease.RunLease(run_dir, "run").acquire()
        assert str(held.value).startswith(f"{path}: run 'run' is held by an unreadable lease ("), held.value
        old = time.time() - lease.EXPIRES_S - 10
        os.utime(path, (old, old))
        capfd.readouterr()
        with lease.RunLease(run_dir, "run"):
            pass
        (line,) = satp_lines(capfd.readouterr().err)
        assert line.startswith(f"satp: warning: {path}: the lease of run 'run' held by an unreadable lease"), line
        assert not path.exists()


def test_lease_on_a_full_disk_is_one_line(tmp_path, small_disk):
    """L x full disk: the lease cannot be written: one line naming it and saying the disk is full."""
    from pipeline.train import lease

    disk = small_disk.mount("1m")
    (disk / "run").mkdir()
    small_disk.fill(leave=0)
    with pytest.raises(OSError) as full:
        lease.RunLease(disk / "run", "run").acquire()
    assert str(full.value).startswith(f"{disk / 'run' / lease.LEASE_FILE}: the disk is full"), full.value
    assert full.value.errno == 28 and "\n" not in str(full.value)


RACE = r'''
import sys, time
from pipeline.train.lease import LeaseHeld, RunLease
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
try:
    held = RunLease(sys.argv[1], "run").acquire()
except LeaseHeld as exc:
    print("refused", exc, flush=True)
else:
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
    held.release()
'''


def test_lease_second_writers_at_the_same_moment_one_wins(tmp_path):
    """L x second writer: four real processes take one run's lease at the same instant; exactly
    one holds it, each other is refused in one line naming that one's pid."""
    run_dir = tmp_path / "run"
    start = time.time() + 3  # after every interpreter has started
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(run_dir), str(start), "5"], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT) for _ in range(4)]
    outs = {p.pid: p.communicate(timeout=120)[0].strip() for p in procs}
    winners = [pid for pid, out in outs.items() if out == "held"]
    assert len(winners) == 1, outs
    for pid, out in outs.items():
        if pid != winners[0]:
            assert out.startswith("refused ") and f"pid {winners[0]}, since " in out, out


# ============================================================================= the MLflow run
LOGGER = r'''
import sys
from mlflow.tracking import MlflowClient
client = MlflowClient(sys.argv[1])
for step in range(100000):
    client.log_metric(sys.argv[2], "train_loss", 1.0 / (step + 1), step=step)
    print(step, flush=True)
'''


def test_mlflow_run_killed_mid_write_keeps_every_committed_epoch(tmp_path):
    """M x SIGKILL: a process logging into the run's MLflow store (SQLite) killed while it writes.
    The store opens again (SQLite rolls the cut transaction back), the next command's check passes,
    and every metric the killed writer had committed is there."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    writer = subprocess.Popen([sys.executable, "-c", LOGGER, uri, run_id], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    committed = -1
    while committed < 30:
        committed = int(writer.stdout.readline())
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    steps = sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "train_loss"))
    assert steps[: committed + 1] == list(range(committed + 1))


@pytest.mark.ray
@pytest.mark.parametrize("damage", ["cut short", "bit flipped"])
def test_mlflow_store_damaged_is_one_line_before_ray(tiny_setting, tmp_path, capsys, damage):
    """M x truncation / bit flip: the run's tracking database damaged (cut to half; its header's
    bytes flipped). ``satp train`` stops before Ray starts, in one line naming the tracking URI;
    the run's checkpoints would be kept (none are touched)."""
    from mlflow.tracking import MlflowClient

    from pipeline.cli import main

    base, address = tiny_setting
    job = fault_job(base, tmp_path, "store", epochs=1)
    database = tmp_path / "mlflow.db"
    MlflowClient(f"sqlite:///{database}").create_experiment("tiny")
    data = bytearray(database.read_bytes())
    if damage == "cut short":
        data = data[: len(data) // 2]
    else:
        data[:16] = bytes(b ^ 0x20 for b in data[:16])  # "SQLite format 3" -> "sqlITE@FORMAT@..."
    database.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", str(job), "--address", address]) == 2
    (line,) = satp_lines(capsys.readouterr().err)
    assert line.startswith(f"satp: error: mlflow.tracking_uri: sqlite:///{database}: the tracking store cannot be read ("), line
    assert not (tmp_path / "ray" / "store" / "satp-lease.json").exists()


@pytest.mark.ray
def test_mlflow_store_on_a_full_disk_is_one_line(tiny_setting, tmp_path, capsys, small_disk):
    """M x full disk: the tracking database on a file system with no space left. Reading it works,
    the first write (opening the run) does not: one line naming the database and the full disk."""
    from mlflow.tracking import MlflowClient

    from pipeline.cli import main

    base, address = tiny_setting
    disk = small_disk.mount("8m")
    job = fault_job(base, tmp_path, "store-full", epochs=1)
    values = yaml.safe_load(job.read_text())
    values["mlflow"]["tracking_uri"] = f"sqlite:///{disk / 'mlflow.db'}"
    job.write_text(yaml.safe_dump(values))
    MlflowClient(values["mlflow"]["tracking_uri"]).search_experiments()  # the database exists, then the disk fills
    small_disk.fill(leave=0)
    capsys.readouterr()
    assert main(["train", str(job), "--address", address]) == 2
    (line,) = satp_lines(capsys.readouterr().err)
    assert line.startswith(f"satp: error: {disk / 'mlflow.db'}: the disk is full"), line
    assert "nothing was trained" in line, line


# ============================================================================= end to end


@pytest.mark.ray
@pytest.mark.slow
def test_a_second_command_of_one_run_name_is_refused_naming_the_holder(tiny_setting, tmp_path):
    """two ``satp train`` of one run name at once. The second stops before Ray starts, in
    one line naming the first (host, pid, since when), status 2; the first trains on, untouched,
    and releases the lease when it ends."""
    from mlflow.tracking import MlflowClient

    base, address = tiny_setting
    job = fault_job(base, tmp_path, "twice", epochs=1)
    lease = tmp_path / "ray" / "twice" / "satp-lease.json"
    first = subprocess.Popen(train_command(job, address), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=satp_env(), cwd=ROOT)
    drained = Drain(first)
    try:
        wait_until(lease.exists, "lease file of the first command", proc=first)
        _stop(first)  # it holds the lease for as long as the second command takes
        try:
            started = time.monotonic()
            second = run_satp_train(job, address, timeout=300)
            took = time.monotonic() - started
        finally:
            first.send_signal(signal.SIGCONT)
        err = second.stderr
        assert second.returncode == 2, err[-3000:]
        assert satp_lines(err) == satp_lines(err, "error:"), err[-3000:]
        (line,) = satp_lines(err)
        assert line.startswith(f"satp: error: {lease}: run 'twice' is held by satp train on host "), line
        assert f"pid {first.pid}, since " in line, line
        assert "connecting to the Ray cluster" not in err and not tracebacks(err), err[-3000:]
        print(f"refused in {took:.1f} s")
    finally:
        err = drained.finish()
    assert first.returncode == 0, err[-3000:]
    assert not lease.exists()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_f1")] == [0]


@pytest.mark.ray
@pytest.mark.slow
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumed(tiny_setting, tmp_path):
    """The newest checkpoint's model states cut short: the rerun with more
    epochs names the file in one warning line and resumes from the checkpoint before it (which
    Ray had registered as its latest: the worker verifies it too), with no traceback. Then the
    MLflow database deleted: the next command refuses in one line naming the tracking URI and the
    run id its checkpoints log to, creates no new database and registers nothing; with the
    database back, the run is found finished."""
    import shutil

    from mlflow.tracking import MlflowClient

    from pipeline.config import load_job
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.driver import train_job

    base, address = tiny_setting
    job = fault_job(base, tmp_path, "cut", epochs=2, checkpoints_to_keep=2)
    run_dir = tmp_path / "ray" / "cut"
    train_job(load_job(job))
    kept = checkpoint_epochs(run_dir)
    assert sorted(kept.values()) == [0, 1], kept
    newest = next(run_dir / name for name, epoch in kept.items() if epoch == 1)
    target = newest / "ds" / "last" / "mp_rank_00_model_states.pt"
    os.truncate(target, target.stat().st_size // 2)

    more = fault_job(base, tmp_path, "cut", epochs=3, checkpoints_to_keep=2)
    again = run_satp_train(more, address)
    err = again.stderr
    assert again.returncode == 0, err[-3000:]
    warnings = satp_lines(err, "warning:")
    assert len(warnings) == 1 and warnings[0].startswith(f"satp: warning: {target}: "), warnings
    assert "epoch 1" in warnings[0] and "cut short" in warnings[0], warnings[0]
    # said once, by the driver: the worker that verifies Ray's registered checkpoint does not repeat it
    assert [line for line in err.splitlines() if "satp: warning:" in line] == warnings, err[-3000:]
    assert "resuming run cut after epoch 0" in err, err[-3000:]
    assert not tracebacks(err), err[-3000:]
    final = checkpoint_epochs(run_dir)
    assert max(final.values()) == 2 and all(ckpt.CheckpointManager(run_dir).verify(name) is None
                                         for name, e in final.items() if e == 2)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(run.info.run_id, "val_f1")} == {0, 1, 2}
    # the run says it went back, and each value names its trajectory
    went_back = run.data.tags["satp.fell_back"]
    assert "went back from epoch 1 to epoch 0 (the checkpoint of epoch 1 (" in went_back and "cut short" in went_back
    segment = {(m.step, m.timestamp): m.value for m in client.get_metric_history(run.info.run_id, "segment")}
    values = sorted((m.step, segment[(m.step, m.timestamp)]) for m in client.get_metric_history(run.info.run_id, "val_f1"))
    assert values == [(0, 0), (1, 0), (1, 1), (2, 1)], values

    # the tracking store deleted under the run's checkpoints
    database = tmp_path / "mlflow.db"
    shutil.move(database, tmp_path / "mlflow.db.saved")
    lost = run_satp_train(more, address)
    err = lost.stderr
    assert lost.returncode == 2, err[-3000:]
    (line,) = satp_lines(err)
    assert line.startswith(f"satp: error: mlflow.tracking_uri: sqlite:///{database}: "), line
    assert run.info.run_id in line and "--restart" in line, line
    assert not database.exists() and "Created version" not in err and not tracebacks(err)
    shutil.move(tmp_path / "mlflow.db.saved", database)
    found = run_satp_train(more, address)
    assert found.returncode == 0, found.stderr[-3000:]
    assert "had finished with this configuration" in found.stdout, found.stdout


SIGNALS_WHILE_ENDING = r'''
import atexit, os, signal, sys
from pipeline.cli import _interrupted
from runtime import interrupts

interrupts.reset()
interrupts.install()
atexit.register(lambda: print("exit clean-up done", flush=True))  # registered first: runs last
atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))  # Ctrl-C again while the process exits
try:
    with interrupts.deferred():  # a clean-up a signal must not cut short: it waits for the end
        os.kill(os.getpid(), signal.SIGINT)
        print("clean-up done", flush=True)
    print("not reached", flush=True)
except KeyboardInterrupt as exc:
    interrupts.ending()  # what satp train does when it catches the interrupt
    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's SIGTERM while the command ends
    sys.exit(_interrupted(exc))
'''


def test_signals_while_a_command_ends_wait_or_are_ignored_and_the_status_is_the_first():
    """Each phase for certain: a signal inside a clean-up waits for its end, then
    interrupts; once the command ends, SIGTERM and a SIGINT during the exit clean-up change nothing:
    the clean-up at exit runs, one line, status 130 (the first signal's)."""
    done = subprocess.run([sys.executable, "-c", SIGNALS_WHILE_ENDING], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.stdout.split("\n")[:2] == ["clean-up done", "exit clean-up done"], done.stdout + done.stderr
    assert done.returncode == 130, done.stderr
    assert satp_lines(done.stderr) == [done.stderr.strip()] and done.stderr.startswith("satp: interrupted (SIGINT): ")


def _processes_under(prefix: Path) -> dict[int, str]:
    """Processes (not zombies) whose ``TMPDIR`` lies under ``prefix``: a local Ray cluster's processes
    started by a command run with ``TMPDIR=prefix`` (its head gets a private folder there)."""
    found = {}
    needle = f"TMPDIR={prefix}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.ray
@pytest.mark.slow
def test_more_ctrl_c_while_the_first_is_handled_keep_status_130_and_tear_the_cluster_down(tiny_setting, tmp_path):
    """Ctrl-C to ``satp train`` on its own local Ray cluster, then again every 0.35 s
    while the command handles the first (Ray Train aborting, the command saying what it kept, Ray
    shutting down, the interpreter exiting): status 130 all the same, one ``satp: interrupted``
    line, the private temporary folder removed and none of the cluster's processes left."""
    base, _ = tiny_setting
    job = fault_job(base, tmp_path, "taps", epochs=50)
    private = Path(tempfile.mkdtemp(prefix="sig", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        # its own process group, signalled as a whole: what Ctrl-C in a terminal does (the local
        # cluster's processes, children of the command, get the signal too)
        # SATP_HOME without a record: not the session's satp cluster, a local Ray of the command's own
        # and no $RAY_ADDRESS (the session's cluster, set for the other tests' commands)
        env = satp_env(TMPDIR=str(private), SATP_HOME=str(tmp_path / "home"))
        for key in SESSION_CLUSTER_VARS:
            env.pop(key, None)
        proc = subprocess.Popen(train_command(job, None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=ROOT, start_new_session=True)
        drained = Drain(proc)
        run_dir = tmp_path / "ray" / "taps"
        wait_until(lambda: any(run_dir.glob("checkpoint_*/rank_0.json")), "first checkpoint", timeout=400, proc=proc)
        assert set(_processes_under(private)) - {proc.pid}, "the command runs no Ray cluster of its own"
        os.killpg(proc.pid, signal.SIGINT)
        # the second 0.35 s later, then one every 0.35 s until the command has exited: one of them
        # lands in each phase of its shutdown, whatever the machine's speed
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.35)
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                break
        err = drained.finish(timeout=60)
        assert proc.returncode == 130, err[-3000:]
        lines = satp_lines(err)
        assert len(lines) == 1 and lines[0].startswith("satp: interrupted (SIGINT): run taps kept its checkpoint"), \
            err[-3000:]
        assert not tracebacks(err), err[-3000:]
        assert not list(private.glob("satp-ray-*")), "the cluster's private temporary folder is left"
        # Ray's shutdown stops what it started before the command exits; its agents end with their raylet
        left = _processes_under(private)
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _processes_under(private)
        assert not left, f"processes of the command's Ray cluster still running: {left}"
    finally:
        for pid in _processes_under(private):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        import shutil

        shutil.rmtree(private, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
def test_a_full_disk_ends_the_run_in_one_line_and_keeps_the_intact_checkpoint(tiny_setting, tmp_path, small_disk):
    """the run's storage and its MLflow store on one
    real file system (2 workers; one epoch trained, its model not registered yet).

    * full while the model is registered: one line naming the file, nothing registered;
    * space freed, the registration killed (SIGKILL) between the version and its champion decision:
      the next command makes that decision, without a second version;
    * full while the checkpoint of epoch 1 is written (a continuation to 3 epochs): the run ends at
      once, not retried as a worker failure: one ``satp: error:`` line naming the path and saying
      the disk is full, non-zero status; the partial checkpoint is removed, the intact one of
      epoch 0 kept."""
    from mlflow.tracking import MlflowClient

    from pipeline.config import load_job
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.driver import train_job

    base, address = tiny_setting
    storage = small_disk.mount("64m")
    uri = f"sqlite:///{storage / 'mlflow.db'}"

    def job_file(epochs: int) -> Path:
        path = fault_job(base, tmp_path, "full", storage=storage, workers=2, epochs=epochs)
        values = yaml.safe_load(path.read_text())
        values["mlflow"]["tracking_uri"] = uri
        path.write_text(yaml.safe_dump(values))
        return path

    train_job(load_job(job_file(1)), register=False)
    run_dir = storage / "full"
    (epoch0,) = checkpoint_epochs(run_dir)
    size = sum(p.stat().st_size for p in (run_dir / epoch0).rglob("*") if p.is_file())
    client = MlflowClient(uri)

    filler = small_disk.fill(leave=200_000)  # room for the lease and the database's journal, not the model
    unregistered = run_satp_train(job_file(1), address)
    err = unregistered.stderr
    assert unregistered.returncode != 0, err[-3000:]
    (line,) = satp_lines(err)
    assert line.startswith(f"satp: error: {storage}/") and "disk is full" in line, line
    assert "nothing was registered" in line and not tracebacks(err), err[-3000:]
    assert not client.search_model_versions("name='sat-full'")
    filler.unlink()

    killed = run_satp_train(job_file(1), address, SATP_TEST_KILL_AT="registration")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (version,) = client.search_model_versions("name='sat-full'")
    assert "satp.champion_decision" not in version.tags
    finished = run_satp_train(job_file(1), address)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "its model: models:/sat-full/1" in finished.stdout, finished.stdout
    assert len(client.search_model_versions("name='sat-full'")) == 1
    assert str(client.get_model_version_by_alias("sat-full", "champion").version) == "1"

    filler = small_disk.fill(leave=size // 2)
    stopped = run_satp_train(job_file(3), address)
    err = stopped.stderr
    assert stopped.returncode != 0, err[-3000:]
    assert "resuming run full after epoch 0" in err, err[-3000:]
    lines = satp_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"satp: error: {storage}/"), err[-3000:]
    assert "disk is full" in lines[0] and "epoch 1" in lines[0] and "epoch 0" in lines[0], lines[0]
    assert "FailurePolicy" not in err and not tracebacks(err), err[-3000:]
    assert list(checkpoint_epochs(run_dir).values()) == [0]
    assert {p.name for p in run_dir.glob("checkpoint_*") if p.is_dir()} == {epoch0}
    assert ckpt.CheckpointManager(run_dir).verify(epoch0) is None
