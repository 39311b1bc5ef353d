"""One writer per sweep, and an interrupted sweep's last line.

Two ``satp tune`` of one ``tune.name`` started 2 s apart ran on one folder and one set of trial runs,
took each other's trial leases and ended in tracebacks and an interrupt nobody sent. A sweep now holds
the run lease of :mod:`pipeline.train.lease` on its folder: a second command is refused in one line
naming the holder, before Ray starts; a dead holder's sweep is taken over with one warning line. And
a ``satp tune`` interrupted with Ctrl-C ends with one ``satp: interrupted`` line, the last of its
output (it was a line of the multi-line summary, followed by Ray's).

The rules at the level of the lease (real processes, a real SIGKILL), then one real ``satp tune``
against the session's Ray cluster for both commands' behaviour (the second started while the first
runs its trial, then the first interrupted as a terminal's Ctrl-C does).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import Drain, satp_env, satp_lines, tiny_job_dict, tracebacks, wait_until

ROOT = Path(__file__).resolve().parents[1]

HOLDER = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from pipeline.sweep.trials import hold_sweep

    with hold_sweep(Path(sys.argv[1]), "s", "satp tune", "tune.name"):
        print("held", flush=True)
        time.sleep(600)
''')


def test_a_sweep_is_held_by_one_command_and_a_dead_holders_is_taken_over(tmp_path, capfd):
    from pipeline.sweep.trials import hold_sweep
    from pipeline.train.lease import LeaseHeld

    sweep_dir = tmp_path / "tune" / "s"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(sweep_dir)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld) as refused:
            with hold_sweep(sweep_dir, "s", "satp tune", "tune.name"):
                pass
        line = str(refused.value)
        assert line.startswith(f"{sweep_dir / 'satp-lease.json'}: sweep 's' is held by satp tune on host "), line
        assert f"pid {holder.pid}, since " in line and line.endswith("pick another tune.name"), line
    finally:
        holder.kill()
        holder.wait()
    capfd.readouterr()
    with hold_sweep(sweep_dir, "s", "satp tune", "tune.name"):
        assert (sweep_dir / "satp-lease.json").is_file()
    (warning,) = capfd.readouterr().err.strip().splitlines()
    assert warning.startswith(f"satp: warning: {sweep_dir / 'satp-lease.json'}: the lease of sweep 's' held by "
                              f"satp tune on host "), warning
    assert f"pid {holder.pid}" in warning and "its process is no longer running): taken over" in warning, warning
    assert not (sweep_dir / "satp-lease.json").exists()


def _sweep_job(base: Path, where: Path) -> Path:
    values = tiny_job_dict(base, run_name="w", storage_path=str(where / "ray"), epochs=50, train_subset=300,
                           eval_subset=100)
    values["resources"] |= {"num_workers": 1, "cpus_per_worker": 1}
    values["mlflow"] |= {"tracking_uri": f"sqlite:///{where / 'mlflow.db'}", "registered_model": "sat-w"}
    values["tune"] = {"name": "w", "storage_path": str(where / "tune"), "num_samples": 1, "metric": "val_f1",
                      "mode": "max", "max_concurrent_trials": 1,
                      "asha": {"grace_period": 1, "reduction_factor": 2, "max_epochs": 50},
                      "space": {"train.lr": {"grid": [1e-3]}}}
    path = where / "sweep.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _tune(job: Path, address: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "tune", str(job), "--no-progress", "--address", address]


@pytest.mark.ray
@pytest.mark.slow
def test_a_second_sweep_is_refused_and_an_interrupted_one_ends_with_its_line(tiny_setting, tmp_path):
    base, address = tiny_setting
    job = _sweep_job(base, tmp_path)
    lease = tmp_path / "tune" / "w" / "satp-lease.json"
    first = subprocess.Popen(_tune(job, address), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=satp_env(), cwd=ROOT, start_new_session=True)
    drained = Drain(first)
    try:
        # the trial's Train run holds its own lease: Tune is fitting
        wait_until(lambda: any((tmp_path / "tune" / "w" / "train").glob("*/satp-lease.json")), "the trial's run",
                  timeout=400, proc=first)
        assert lease.is_file()
        started = time.monotonic()
        second = subprocess.run(_tune(job, address), capture_output=True, text=True, timeout=300, env=satp_env(), cwd=ROOT)
        took = time.monotonic() - started
        err = second.stderr
        assert second.returncode == 2, err[-3000:]
        (line,) = satp_lines(err)
        assert line.startswith(f"satp: error: {lease}: sweep 'w' is held by satp tune on host "), line
        assert f"pid {first.pid}, since " in line, line
        assert "connecting to the Ray cluster" not in err and not tracebacks(err), err[-3000:]
        print(f"second sweep refused in {took:.1f} s")
        os.killpg(first.pid, signal.SIGINT)  # a terminal's Ctrl-C
        err = drained.finish(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("satp: interrupted (SIGINT): sweep w kept its finished trials"), err[-3000:]
    assert "the same command resumes it" in last and satp_lines(err) == [last], err[-3000:]
    assert not lease.exists()  # released: the same command resumes the sweep
