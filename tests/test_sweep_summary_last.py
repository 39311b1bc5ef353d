"""The summary of ``satp tune`` / ``satp compare`` is the command's last output.

A user's ``satp tune`` printed Ray's lines after its summary: a Train worker's late epoch line,
gRPC's goodbye to a closed connection; Ray forwards what its processes print, and shut down only at
the process's exit. Now the command shuts Ray down, once the last lines have come, before it prints
the summary. Here a sweep command's own code path (``run_section_command``) in a process of its own,
on the session's cluster, with a run whose actor prints a line every 20 ms and keeps printing after
the run has returned: every one of its lines that reaches the command comes before the summary.
(Whole ``satp tune`` commands end with their summary in ``tests/test_sweep_rerun.py``.)
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers import satp_env, tiny_job_dict

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = ["sweep chatty: 0 trials", "MLflow parent run - (-)"]

COMMAND = textwrap.dedent('''
    import argparse, sys
    from pipeline.cli.sweep_commands import run_section_command

    args = argparse.Namespace(job=sys.argv[1], overrides=[], address=sys.argv[2], restart=False, section="tune",
                              example="jobs/code2-sweep-local.yaml", run="tests.test_sweep_summary_last:chatty_run")
    sys.exit(run_section_command(args))
''')


class Outcome:
    interrupted = False


def chatty_run(job, address: str, **_) -> Outcome:
    """A sweep's part of the command: connected to Ray, with an actor that prints on and on."""
    import time

    import ray

    ray.init(address=address)

    @ray.remote(num_cpus=0)
    class Chatty:
        def start(self) -> None:
            import threading

            def talk() -> None:
                count = 0
                while True:
                    print(f"chatty line {count}", flush=True)
                    count += 1
                    time.sleep(0.02)

            threading.Thread(target=talk, daemon=True).start()

    chatty = Chatty.remote()
    ray.get(chatty.start.remote())
    time.sleep(2)  # its lines reach this process meanwhile, and keep coming
    return Outcome()


def format_outcome(outcome: Outcome) -> str:
    return "\n".join(SUMMARY)


@pytest.mark.ray
def test_nothing_of_rays_comes_after_the_summary(ray_cluster, tmp_path):
    job = tiny_job_dict(tmp_path)
    job["tune"] = {"name": "chatty", "storage_path": str(tmp_path / "tune"), "space": {"train.lr": {"grid": [1e-3]}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = subprocess.run([sys.executable, "-c", COMMAND, str(tmp_path / "job.yaml"),
                           ray_cluster.get_runtime_context().gcs_address],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                          env=satp_env(PYTHONUNBUFFERED="1"), cwd=ROOT)
    lines = proc.stdout.rstrip("\n").splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert any("chatty line" in line for line in lines), proc.stdout[-3000:]  # Ray forwarded the actor's lines
    assert lines[-len(SUMMARY):] == SUMMARY, "\n".join(lines[-10:])
