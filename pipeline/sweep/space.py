"""The search space of a sweep: its values applied to the job as dotted keys, each sampled job
validated against the job's schema before any trial starts, and the preprocessing variants it
spans (keys under ``data`` / ``transform`` / ``shards``), each built once by the driver."""
from __future__ import annotations

import copy
import itertools
import json
from typing import Any

from pipeline.config import JobConfig, format_validation_error, set_dotted
from pipeline.config.tune import DATA_SECTIONS, split_key


def apply_config(raw: dict, config: dict[str, Any]) -> dict:
    """A copy of the job dict ``raw`` with a trial's sampled ``config`` set at its dotted keys."""
    out = copy.deepcopy(raw)
    for key, value in config.items():
        for part in split_key(key):
            set_dotted(out, part, value)
    return out


def base_job_dict(job: JobConfig) -> dict:
    """The job as a dict, without its ``tune`` and ``compare`` sections."""
    return job.model_dump(mode="json", exclude={"tune", "compare"})


def validate_raw(raw: dict, where: str) -> JobConfig:
    from pydantic import ValidationError

    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(format_validation_error(where, exc)) from None


def space_jobs(job: JobConfig) -> list[JobConfig]:
    """The job with every value the space can sample (each key varied from the first values of
    the others); raises a one-line error naming the key when a value gives an invalid job."""
    raw = base_job_dict(job)
    first = {key: dist.candidates()[0] for key, dist in job.tune.space.items()}  # settings that go together
    jobs = []  # the first values of every key come first
    for key, dist in job.tune.space.items():
        for value in dist.candidates():
            jobs.append(validate_raw(apply_config(raw, {**first, key: value}), f"tune.space.{key} = {value!r}"))
    return jobs


def data_variants(job: JobConfig) -> list[dict[str, Any]]:
    """Every combination of the preprocessing-changing keys of the space (``[{}]`` when none)."""
    keys = [k for k in job.tune.space if any(p.split(".")[0] in DATA_SECTIONS for p in split_key(k))]
    values = [job.tune.space[k].candidates() for k in keys]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def variant_key(config: dict[str, Any], keys: list[str]) -> str:
    return json.dumps({k: config[k] for k in sorted(keys)}, sort_keys=True, default=str)


def resolve_paths(raw: dict) -> dict:
    """Relative data/shard roots and source dirs resolved against the driver's cwd (trials run
    elsewhere); a URI stays as written."""
    from runtime.storage import absolute

    raw = copy.deepcopy(raw)
    data = raw["data"]
    data["root"] = absolute(data["root"])
    if data.get("source_dirs"):
        data["source_dirs"] = [absolute(d) for d in data["source_dirs"]]
    raw["shards"]["root"] = absolute(raw["shards"]["root"])
    return raw


def task_metric(job: JobConfig) -> tuple[str, str, str]:
    """``(task name, task metric, task mode)`` of the job (without reading any data)."""
    from pipeline.tasks import TASK_CLASSES, task_name_for

    name = task_name_for(job.train.task, job.data.name)
    return name, TASK_CLASSES[name].metric, TASK_CLASSES[name].mode
