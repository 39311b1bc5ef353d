"""Ray Train's console noise off the console (runtime/ray_logs.py).

Successful runs under load printed Ray Train's controller warning "Failed to send resource request ...
it's safe to ignore this error" with a whole ``GetTimeoutError`` traceback: its request to Ray's
autoscaling coordinator waits 5 s. Here Ray's own client (``TrainAutoscalingCoordinatorClient``) sends
its request, in a Ray actor of a real job on the session's cluster, to a coordinator actor that
answers after 30 s, with the controller's console logging as Ray Train configures it; the driver prints
what its workers log. The job's worker processes ran ``runtime.ray_logs`` when they started (the
job's ``worker_process_setup_hook``, as every satp job's), so the traceback does not reach the console, and the same warning
about any other error still does; with the filters taken off in the actor, the traceback shows (the
defect). The placement-group cleaner's every-second warning without a dashboard is lowered too.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DONE = "satp-test: the controller has logged"

DRIVER = textwrap.dedent('''
    import logging, sys, time
    import ray

    keep_filters = sys.argv[2] == "as-started"
    from runtime.ray_cluster import job_env

    ray.init(address=sys.argv[1], log_to_driver=True, runtime_env=job_env())  # a satp job's hook

    @ray.remote(num_cpus=0)
    class SlowCoordinator:
        def request_resources(self, **request):
            time.sleep(10)  # longer than the 5 s the client waits

    @ray.remote(num_cpus=0)
    class Controller:
        def run(self, coordinator):
            from ray._private.log import PlainRayHandler
            from ray.train import ScalingConfig
            from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
                TrainAutoscalingCoordinatorClient)
            from ray.train.v2._internal.logging.logging import TrainLogLevelFilter

            console = PlainRayHandler()  # the controller's console, as Ray Train's LoggingManager sets it
            console.addFilter(TrainLogLevelFilter("INFO"))
            train_log = logging.getLogger("ray.train")
            train_log.handlers, train_log.propagate = [console], False
            train_log.setLevel(logging.DEBUG)
            client_log = logging.getLogger(TrainAutoscalingCoordinatorClient.__module__)
            assert client_log.filters, "the worker did not run the job's setup hook (runtime.ray_logs) when it started"
            if not keep_filters:
                client_log.filters.clear()
            client = TrainAutoscalingCoordinatorClient("train-test")
            client.__dict__["_autoscaling_coordinator"] = coordinator  # Ray's coordinator, answering late
            client.send_resource_request(ScalingConfig(num_workers=1), 1)  # waits 5 s, then logs
            try:
                raise ValueError("not a timeout")
            except ValueError:
                logging.getLogger(client.__module__).warning("Failed to send resource request (other)", exc_info=True)
            print("DONE", file=sys.stderr, flush=True)

    @ray.remote(num_cpus=0)
    class Cleaner:  # Ray Train's placement-group cleaner: an actor of its own, Ray's default logging
        def run(self):
            cleaner_log = logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner")
            if not keep_filters:
                cleaner_log.filters.clear()
            cleaner_log.warning("Failed to query Ray Train Controller actor state. State API may be temporarily "
                                "unavailable. Continuing to monitor.")

    ray.get(Cleaner.remote().run.remote())
    ray.get(Controller.remote().run.remote(SlowCoordinator.remote()))
    time.sleep(600)  # prints the actors' output until the test has read it
''').replace('"DONE"', repr(DONE))


def _consoles(address: str, *modes: str) -> list[str]:
    """What a driver of each mode prints; the drivers run at once (each waits out the client's 5 s)."""
    drivers = [subprocess.Popen([sys.executable, "-c", DRIVER, address, mode], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
               for mode in modes]
    texts, deadline = [], time.monotonic() + 240
    try:
        for driver in drivers:  # a driver not read yet waits on its pipe: its output is short
            lines = []
            for line in driver.stdout:
                lines.append(line)
                if DONE in line or time.monotonic() > deadline:
                    break
            texts.append("".join(lines))
    finally:
        for driver in drivers:
            driver.kill()
            driver.wait()
    for text in texts:
        assert DONE in text, text[-3000:]
    return texts


@pytest.mark.ray
def test_the_coordinators_timeout_stays_off_the_console_and_other_errors_do_not(ray_cluster):
    address = ray_cluster.get_runtime_context().gcs_address
    without, shown = _consoles(address, "filters-removed", "as-started")
    assert "Failed to send resource request for train-test" in without and "GetTimeoutError" in without, without
    assert "Failed to query Ray Train Controller actor state" in without, without
    assert "train-test" not in shown and "GetTimeoutError" not in shown, shown
    assert "Failed to query Ray Train Controller actor state" not in shown, shown
    assert "Failed to send resource request (other)" in shown and "ValueError: not a timeout" in shown, shown


def test_the_retry_notice_names_the_step_the_retry_and_the_report_and_stops_after_the_last(tmp_path, capsys):
    """Ray Train's controller calls the callback as in a run: reports (one with a checkpoint), then a
    failure per retry. Its lines: before any checkpoint, where the command started it; then the
    checkpoint's global step; none once ``max_failures`` is used up (the run ends; the command says why)."""
    from ray.train import Checkpoint

    from runtime.ray_logs import RetryNotice

    notice = RetryNotice(2, "train.max_failures", str(tmp_path / "run.log"))
    notice.after_exception(None, {1: RuntimeError("gone")})
    notice.after_report(None, [{"global_step": 4, "epoch": 0}], None)  # no checkpoint: not where a retry resumes
    notice.after_report(None, [{"global_step": 10, "epoch": 0}], Checkpoint(str(tmp_path / "checkpoint_b")))
    notice.after_exception(None, {0: RuntimeError("gloo"), 1: RuntimeError("gone")})
    notice.after_exception(None, {1: RuntimeError("gone")})
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "satp: warning: a worker or its node was lost (rank 1): the run went on from where this command started it "
        f"(no checkpoint since); retry 1 of 2 (train.max_failures); Ray's report: {tmp_path / 'run.log'}",
        "satp: warning: a worker or its node was lost (rank 0, 1): the run went on from global step 10 (checkpoint "
        f"checkpoint_b); retry 2 of 2 (train.max_failures); Ray's report: {tmp_path / 'run.log'}"], lines
