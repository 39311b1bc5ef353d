"""An elastic job's settings, below Ray: worker counts against the global batch and the cluster,
and the configuration hash, which keeps the global batch and drops the worker count."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_job
from pipeline.train.preflight import check_resources, describe_counts
from pipeline.train.rerun import config_hash, weights_config

LOCAL_JOB = Path(__file__).resolve().parents[1] / "jobs" / "code2-local.yaml"


def _job(*sets: str):
    return load_job(LOCAL_JOB, list(sets))


def test_the_global_batch_defaults_to_the_largest_worker_count_and_is_stated_when_set():
    assert _job("resources.num_workers=3").train.micro_batches_per_step == 2  # the job states it
    unset = load_job(LOCAL_JOB, ["resources.num_workers=[1, 3]", "train.micro_batches_per_step=null"])
    assert unset.resources.num_workers == (1, 3) and unset.train.micro_batches_per_step == 3
    fixed = load_job(LOCAL_JOB, ["resources.num_workers=[2, 2]"])
    assert fixed.resources.num_workers == 2 and not fixed.resources.elastic  # [n, n] is a count


def test_preflight_says_which_counts_share_a_step_evenly():
    job = _job("resources.num_workers=[1, 6]", "train.micro_batches_per_step=4")
    assert describe_counts(job) == ("resources.num_workers [1, 6], a step's 4 micro-batch(es): 1, 2, 4 worker(s) "
                                    "take equal shares; 3 take 2/1/1; 5 to 6 leave workers idle")


def test_an_elastic_minimum_the_cluster_never_holds_is_one_line_and_a_smaller_one_runs():
    node = [{"Alive": True, "Resources": {"CPU": 2.0}}]
    with pytest.raises(ValueError, match=r"^resources: the job asks for at least 3 worker\(s\) x \(1 CPU\); .* room for 2"):
        check_resources(_job("resources.num_workers=[3, 4]", "train.micro_batches_per_step=4"), nodes=node)
    check_resources(_job("resources.num_workers=[2, 4]", "train.micro_batches_per_step=4"), nodes=node)


def test_an_elastic_fit_gives_ray_train_a_shorter_wait_for_a_new_worker_group(monkeypatch):
    """Ray Train's own propagation (what its controller and workers get from the driver's environment)
    carries the elastic wait while the fit starts, and only then; a fixed run keeps Train's default."""
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    from pipeline.train.driver import ELASTIC_GROUP_START_TIMEOUT_S, GROUP_START_TIMEOUT_VAR, _group_start_timeout

    monkeypatch.delenv(GROUP_START_TIMEOUT_VAR, raising=False)
    with _group_start_timeout(elastic=True):
        assert float(get_env_vars_to_propagate()[GROUP_START_TIMEOUT_VAR]) == ELASTIC_GROUP_START_TIMEOUT_S < 60
    with _group_start_timeout(elastic=False):
        assert GROUP_START_TIMEOUT_VAR not in get_env_vars_to_propagate()
    assert GROUP_START_TIMEOUT_VAR not in get_env_vars_to_propagate()
    monkeypatch.setenv(GROUP_START_TIMEOUT_VAR, "40")  # the user's value stays
    with _group_start_timeout(elastic=True):
        assert get_env_vars_to_propagate()[GROUP_START_TIMEOUT_VAR] == "40"
    assert get_env_vars_to_propagate()[GROUP_START_TIMEOUT_VAR] == "40"


def test_the_configuration_hash_keeps_the_global_batch_and_drops_the_worker_count():
    def digest(*sets):
        return config_hash(weights_config(_job(*sets), {"config_hash": "c", "source": {"fingerprint": "f"}}, "code2"))

    base = digest("resources.num_workers=2")
    assert digest("resources.num_workers=1") == base == digest("resources.num_workers=[1, 4]")
    assert digest("train.checkpoint_every_steps=5", "train.preemption_check_steps=3") == base  # how often, not what
    assert digest("train.micro_batches_per_step=4") != base


def test_worker_group_events_name_the_counts_the_steps_lost_and_the_time_without_progress(tmp_path):
    from pipeline.train.elastic import ProgressNote, describe, read_note, resize_event
    from runtime.storage import resolve

    run = resolve(tmp_path)
    assert read_note(run) is None and resize_event(None, 1.0, 2, 0, 10.0) is None  # a fresh run
    ProgressNote(run, command=1.0, world_size=2).write(7, force=True)
    note = read_note(run)
    event = resize_event(note, 1.0, 1, 6, note["time"] + 41.25)
    assert {k: event[k] for k in ("kind", "from", "to", "step", "steps_lost", "seconds")} == \
        {"kind": "resize", "from": 2, "to": 1, "step": 6, "steps_lost": 1, "seconds": 41.25}
    assert "resize 2 -> 1 workers at step 6" in describe(event) and "1 step(s) lost, 41.2 s" in describe(event)
    assert resize_event(note, 1.0, 2, 6, note["time"])["kind"] == "restart"  # the same count: a worker replaced
    assert resize_event(note, 2.0, 1, 6, note["time"])["kind"] == "resume"  # another command


def test_a_preemption_notice_is_asked_for_at_the_same_steps_on_every_rank_and_taken_once():
    from pipeline.train.elastic import PreemptionCheck

    asked, answers = [], iter([None, "notice", "again"])
    check = PreemptionCheck(every=5, ask=lambda: asked.append(1) or next(answers))  # the context's question
    seen = [(step, check.notice(step)) for step in range(1, 21)]
    assert len(asked) == 2  # steps 5 and 10; after the notice no more collectives
    assert [(s, n) for s, n in seen if n] == [(10, "notice")]
