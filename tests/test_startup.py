"""The start-up breakdown (pipeline/train/startup.py): phases between consecutive events."""
from __future__ import annotations

import time

import pytest

from pipeline.train import startup


def _marks(**moved: float) -> dict[str, float]:
    """One event a second after the previous, from ``command`` at 100 s; ``moved`` overrides."""
    events = ["command"] + [event for event, _phase in startup.PHASES]
    marks = {event: 100.0 + i for i, event in enumerate(events)}
    marks.update(moved)
    return marks


def test_phases_in_order_and_adding_up():
    parts = startup.breakdown(_marks())
    assert list(parts) == [phase for _event, phase in startup.PHASES] + ["to_first_step"]
    assert all(parts[phase] == pytest.approx(1.0) for _event, phase in startup.PHASES)
    assert parts["to_first_step"] == pytest.approx(len(startup.PHASES))


def test_an_early_event_ends_its_phase_at_zero():
    # a worker process Ray started before the trainer asked for it: no negative phase, and the
    # phases still add up to the whole start-up
    marks = _marks(worker_process=90.0)
    parts = startup.breakdown(marks)
    assert parts["worker_processes"] == 0.0
    assert parts["worker_setup"] == pytest.approx(marks["worker"] - marks["fit"])
    total = parts.pop("to_first_step")
    assert sum(parts.values()) == pytest.approx(total)


def test_missing_events_leave_their_phases_out():
    marks = _marks()
    del marks["first_step"], marks["worker_process"]
    parts = startup.breakdown(marks)
    assert "first_step" not in parts and "to_first_step" not in parts and "worker_processes" not in parts
    assert parts["worker_setup"] == pytest.approx(2.0)  # from the previous event present
    assert startup.metrics(marks)["startup_engine_s"] == pytest.approx(1.0)
    assert startup.describe(marks).startswith("start-up: imports 1.0 s")


def test_a_worker_process_started_before_the_fit_is_a_warm_one():
    assert startup.warm(_marks(worker_process=90.0)) is True
    assert startup.metrics(_marks(worker_process=90.0))["startup_warm_worker"] == 1.0
    assert startup.describe(_marks(worker_process=90.0)).endswith("(warm worker process)")
    assert startup.warm(_marks()) is False and startup.describe(_marks()).endswith("(new worker process)")
    marks = _marks()
    del marks["fit"]
    assert startup.warm(marks) is None and "startup_warm_worker" not in startup.metrics(marks)


def test_a_forked_worker_process_is_named_so_and_counted():
    marks = _marks(**{startup.FORKED_FROM: 50.0})  # its server imported long before; the process is new
    assert startup.breakdown(marks) == startup.breakdown(_marks())  # not a phase's event
    assert startup.describe(marks).endswith("(forked worker process)")
    assert startup.metrics(marks)["startup_forked_worker"] == 1.0
    assert startup.metrics(_marks())["startup_forked_worker"] == 0.0


def test_a_forked_worker_stamped_before_the_fit_is_still_a_forked_one():
    # forked on request, so never a warm process, whatever the stamps say (two clocks, one rounding)
    marks = _marks(worker_process=90.0, **{startup.FORKED_FROM: 50.0})
    assert startup.warm(marks) is False
    assert startup.describe(marks).endswith("(forked worker process)")
    assert startup.metrics(marks)["startup_warm_worker"] == 0.0


def test_a_process_start_is_stamped_to_the_clock_tick():
    # psutil's create_time adds the boot time in whole seconds: up to a second early, which made a worker
    # forked right after the fit look started before it
    import subprocess
    import sys

    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    after = time.time()
    try:
        assert before - 0.02 <= startup.process_started(child.pid) <= after + 0.02
    finally:
        child.kill()
        child.wait()
