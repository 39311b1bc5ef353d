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


def test_the_configuration_hash_keeps_the_global_batch_and_drops_the_worker_count():
    def digest(*sets):
        return config_hash(weights_config(_job(*sets), {"config_hash": "c", "source": {"fingerprint": "f"}}, "code2"))

    base = digest("resources.num_workers=2")
    assert digest("resources.num_workers=1") == base == digest("resources.num_workers=[1, 4]")
    assert digest("train.checkpoint_every_steps=5", "train.preemption_check_steps=3") == base  # how often, not what
    assert digest("train.micro_batches_per_step=4") != base
