"""A fault the run survives is one ``satp`` line; Ray's report of it goes to the run's log file.

A Train worker killed (SIGKILL) in a 2-worker ``satp train`` used to print ~115 lines of Ray's on the
terminal: tracebacks from both ranks, gloo's "Connection reset by peer", ``ActorDiedError``, the
raylet's guess at the OOM killer. Here the real command runs on the session's cluster with the test
hook that kills rank 1 once in epoch 1 (``$SATP_TEST_FAULT``, :mod:`pipeline.train.faults`): the run
finishes, its standard error holds one ``satp: warning`` line (what was lost, the global step it went
on from, retry 1 of 2) and none of Ray's report, which is in the log file the line names; satp's own
lines from the workers (the epochs) are still shown. The console's splitting of Ray's lines is also
tested on its own, with Ray's two-write lines from threads that interleave.
"""
from __future__ import annotations

import io
import json
import re
import threading
from pathlib import Path

import pytest

from tests.helpers import fault_job, run_satp_train, satp_lines

RAY_NOISE = ("Traceback", "ActorDiedError", "Connection reset", "Connection closed", "(raylet)",
             "(TrainController pid=", "OOM killer")


@pytest.mark.ray
@pytest.mark.slow
def test_a_lost_worker_is_one_line_and_rays_report_is_in_the_log_file(tiny_setting, tmp_path):
    base, address = tiny_setting
    job = fault_job(base, tmp_path, "survives", workers=2, epochs=2, max_failures=2)
    marker = tmp_path / "killed"
    # rank 1 SIGKILLs itself at step 1 of epoch 1, >= 10 s into the epoch (epoch 0's checkpoint is
    # registered by then: tests/test_train_ray.py)
    fault = {"rank": 1, "epoch": 1, "step": 1, "seconds": 10.0, "marker": str(marker)}
    done = run_satp_train(job, address, SATP_TEST_FAULT=json.dumps(fault), SATP_RUNS_DIR=str(tmp_path / "runs"))
    output = done.stdout + done.stderr
    assert done.returncode == 0, done.stderr[-4000:]
    assert marker.exists(), "the worker was not killed"

    warnings = satp_lines(done.stderr, "warning")
    assert len(warnings) == 1, done.stderr[-4000:]
    line = warnings[0]
    # rank 1 was killed; rank 0 raised in its collective (not the cause) or, where its process ended
    # with its peer (a forked worker), was lost with it
    assert re.match(r"satp: warning: a worker or its node was lost \(rank (0, )?1\): the run went on from global "
                    r"step ", line), line
    assert "retry 1 of 2 (train.max_failures)" in line, line
    steps_of_epoch_0 = int(re.search(r"epoch 0: \{.*'steps': (\d+)", done.stderr).group(1))
    assert f"from global step {steps_of_epoch_0} (checkpoint checkpoint_" in line, line
    for noise in RAY_NOISE:
        assert noise not in output, (noise, output[-4000:])
    # satp's own lines from the workers are shown, with Ray's prefix naming the process
    assert re.search(r"^\(RayTrainWorker pid=\d+\) epoch 1: \{", done.stderr, re.M), done.stderr[-4000:]
    assert "resumed at global step" in done.stderr

    report = Path(line.rsplit("Ray's report: ", 1)[1])
    print(line, "\n", "\n".join(l for l in report.read_text().splitlines() if "Error Snippet" in l or "died" in l))
    assert report.parent == tmp_path / "runs" / "logs" and report.name.startswith("survives-"), report
    text = report.read_text()
    assert "ActorDiedError" in text and "(RayTrainWorker pid=" in text and "Traceback" in text, text[-3000:]
    assert "satp: warning: a worker or its node was lost" in text  # the log file keeps satp's lines too


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rays_lines_go_to_the_file_and_satps_are_shown(tmp_path):
    from pipeline.console import RayReport, WithoutRayLines

    terminal = Terminal()
    stream = WithoutRayLines(terminal, RayReport(tmp_path / "logs" / "run.log"))
    assert stream.isatty() and not (tmp_path / "logs").exists()  # nothing of Ray's yet: no file
    ray_lines = [f"(RayTrainWorker pid=7) Traceback line {i}" for i in range(200)]
    satp_info = [f"\x1b[36m(RayTrainWorker pid=7)\x1b[0m satp: epoch {i}: {{'loss': 1.0}}" for i in range(200)]
    start = threading.Barrier(3)

    def ray_thread(lines: list[str]) -> None:  # Ray prints a line's text, then its newline
        start.wait()
        for text in lines:
            stream.write(text)
            stream.write("\n")

    def driver_thread() -> None:
        start.wait()
        for i in range(200):
            stream.write(f"2026-12-03 10:00:00,000 pipeline.train.driver: driver line {i}\n")

    threads = [threading.Thread(target=ray_thread, args=(ray_lines,)), threading.Thread(target=ray_thread, args=(satp_info,)),
               threading.Thread(target=driver_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stream.write("(raylet) A worker died or was killed\n")
    stream.write("(TrainController pid=9) satp: warning: a worker or its node was lost (rank 1): ...\n")
    stream.write("(not Ray's) a line of the driver in brackets\nprogress 10%\rprogress 20%")
    shown = terminal.getvalue().split("\n")  # the last: the unfinished progress line
    kept = (tmp_path / "logs" / "run.log").read_text().splitlines()

    assert sorted(l for l in shown if "driver line" in l) == sorted(f"2026-12-03 10:00:00,000 pipeline.train.driver: "
                                                                    f"driver line {i}" for i in range(200))
    assert [l for l in shown if "epoch" in l] == [f"\x1b[36m(RayTrainWorker pid=7)\x1b[0m epoch {i}: {{'loss': 1.0}}"
                                                  for i in range(200)]
    assert not [l for l in shown if "Traceback" in l or "raylet" in l]
    assert "satp: warning: a worker or its node was lost (rank 1): ..." in shown
    assert shown[-2:] == ["(not Ray's) a line of the driver in brackets", "progress 10%\rprogress 20%"]
    assert [l for l in kept if "Traceback" in l] == ray_lines  # whole lines, in order, without colour
    assert len([l for l in kept if "satp: epoch" in l]) == 200 and not [l for l in kept if "\x1b[" in l]
    assert "(raylet) A worker died or was killed" in kept and not [l for l in kept if "driver line" in l]
