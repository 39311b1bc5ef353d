"""Shared fixtures. Ray-based tests share one local cluster per session (see `ray_cluster`)."""
from __future__ import annotations

import os

os.environ.setdefault("OUTDATED_IGNORE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (starting one costs ~5 s and ~1 GiB)."""
    import ray

    from pipeline.cluster import init_local_ray

    if not ray.is_initialized():
        init_local_ray(num_cpus=2, dashboard=False, log_to_driver=False, env_vars={"DS_ACCELERATOR": "cpu"})
    yield ray
    ray.shutdown()
