"""What a padded step costs CPU workers, said before they start.

``train.step: static`` and ``compiled`` took 123-126 s an epoch against 3-6 s eager on a local code2
job, without a word: every batch is padded to the capacity's longest graph under dense attention.
The driver now measures the first epoch's batches of the real shards, padded and eager, and says what
padding costs there in one warning line; the ``captured`` refusal on CPU no longer recommends the two
padded modes.
"""
from __future__ import annotations

import pytest

from tests.helpers import tiny_data, tiny_job_dict


def _job(base, **train):
    from pipeline.config import JobConfig

    values = tiny_job_dict(base, **train)
    return JobConfig.model_validate(values)


@pytest.fixture(scope="module")
def shards(tiny_setting):
    from pipeline.train.loader import open_split
    from pipeline.train.plan import worker_setup
    from sat.config import SATConfig

    base, _ = tiny_setting
    job = _job(base)
    shard_dir = tiny_data(base)  # built once per session: found here
    return base, SATConfig.from_dict(worker_setup(job, shard_dir).model_config), open_split(shard_dir, "train")


@pytest.mark.ray
@pytest.mark.parametrize("step", ["static", "compiled"])
def test_a_padded_step_on_cpu_says_what_it_costs_on_the_shards(shards, step):
    from pipeline.train.step_cost import padding_cost

    base, config, train = shards
    line = padding_cost(_job(base, step=step), config, train)
    assert line is not None and line.startswith(f"train.step: '{step}' on CPU workers pads every batch to the capacity"), line
    assert "x the node rows and" in line and line.endswith("train.step: eager is the CPU's mode") and "\n" not in line
    attention = float(line.split("x the attention work")[0].rsplit(" ", 1)[1])
    assert attention > 1.5, line


@pytest.mark.ray
def test_eager_and_gpu_workers_are_not_told(shards):
    from pipeline.config import JobConfig
    from pipeline.train.step_cost import padding_cost

    base, config, train = shards
    assert padding_cost(_job(base), config, train) is None
    gpu = tiny_job_dict(base, step="static")
    gpu["resources"] |= {"use_gpu": True}
    assert padding_cost(JobConfig.model_validate(gpu), config, train) is None


def test_the_captured_refusal_on_cpu_advises_eager(tmp_path):
    from pipeline.train.preflight import check_config

    with pytest.raises(ValueError) as refused:
        check_config(_job(tmp_path, step="captured"))
    line = str(refused.value)
    assert "on CPU use 'eager' (the default)" in line and "use 'compiled' or 'static'" not in line, line
