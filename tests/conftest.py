"""Shared fixtures. Ray-based tests share one local cluster per session (see `ray_cluster`)."""
from __future__ import annotations

import os

os.environ.setdefault("OUTDATED_IGNORE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
