"""The machine a benchmark ran on, in the words every section of ``benchmarks/RESULTS.md`` uses:
ratios mean something only within one run on one machine (one 2-core machine had AVX-512
bf16, the next AVX2 only), so every section says which CPU, which flags and which GPU."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> str:
    """The CPU flags that decide what bf16 costs here: avx2, avx512f, avx512_bf16, amx_bf16."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return ", ".join(f for f in wanted if f" {f}" in flags) or "none of avx2/avx512"


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "none"


def describe() -> str:
    """One line: CPU, cores, GPU, Python and torch versions."""
    import torch

    return (f"{cpu_model()}, {os.cpu_count()} cores, GPU: {gpu_name()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")
