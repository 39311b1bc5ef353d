"""Loader benchmark: the training DataLoader alone, no model (``BENCH=loader make bench``).

    python -m benchmarks.cpu.loader --shards DIR --budget N --workers W [--job JOB] [--seconds S]

iterates the training loader exactly as a Ray Train worker builds it (the job's sampler and loader,
:func:`pipeline.train.batching.split_sampler` and :func:`pipeline.train.loader.make_loader`, the model
configuration resolved by :func:`pipeline.train.plan.worker_setup`; the job defaults to ``jobs/<task>.yaml`` of
the shards' task, with ``train.node_budget`` and ``train.loader_workers`` set to N and W) and prints
graphs/s. ``--per-item`` builds the same batches as the loader did before the batch path (``ds[i]``
per graph, ``Batch.from_data_list``), for comparison. One loader process is ``--workers 1``: the main
process only receives the batches, so the graphs/s are that worker's while the main process keeps
up. "Graphs per loader CPU-s" divides the graphs by the CPU seconds the loader processes used
(``/proc``): what one loader process delivers with a core of its own, whatever else the machine runs.

``run()`` (``make bench``) builds small code2 (Python standard library) and ppa (synthetic) shards
with the jobs' transforms and measures both paths at the jobs' budgets (jobs/code2.yaml 131072,
jobs/ppa.yaml 16384 and its evaluation budget 65536).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# make bench: shards of the standard library's larger packages (~4k functions) and 600 synthetic ppa graphs
PACKAGES = ("asyncio", "email", "multiprocessing", "idlelib", "tkinter", "concurrent", "xml", "json")
PPA_GRAPHS = 600


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _PerItem:
    """The per-item path, for comparison: a dataset without ``batch``, so the loader decodes ``ds[i]``
    per graph and the collator collates them with PyG."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, index: int):
        return self.dataset[index]


def _parts(shards: str | Path, budget: int, workers: int, job: str | Path | None):
    """The job (``train.node_budget``, ``train.loader_workers`` set), train split, sampler and
    collator, as the driver and a Ray Train worker make them."""
    from pipeline.config import load_job
    from pipeline.train.loader import BatchCollator, open_split
    from pipeline.train.plan import worker_setup as plan
    from pipeline.train.batching import split_sampler
    from sat.config import SATConfig

    dataset = open_split(shards, "train")
    job_file = job or ROOT / "jobs" / f"{dataset.manifest['task']}.yaml"
    config = load_job(job_file, [f"train.node_budget={budget}", f"train.loader_workers={workers}"])
    collator = BatchCollator(SATConfig.from_dict(plan(config, shards).model_config))
    return config, dataset, split_sampler(config, dataset, shuffle=True), collator


def measure(shards: str | Path, budget: int, workers: int, job: str | Path | None = None,
            seconds: float = 10.0, per_item: bool = False) -> dict:
    """Graphs/s of the training loader over ``shards`` (see the module docstring)."""
    import torch

    from pipeline.train.loader import make_loader

    config, dataset, sampler, collator = _parts(shards, budget, workers, job)
    loader = make_loader(_PerItem(dataset) if per_item else dataset, _one_rank(sampler), collator,
                         config.train.loader_workers, pin_memory=False)
    if workers == 0:
        torch.set_num_threads(1)  # as in a DataLoader worker process
    started = time.perf_counter()
    batches = iter(loader)
    next(batches)  # workers started, shards opened and verified
    first = time.perf_counter() - started
    pids = [p.pid for p in multiprocessing.active_children()] if workers else [os.getpid()]
    cpu0 = sum(_cpu_seconds(p) for p in pids)
    graphs = steps = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds or steps < 3:
        graphs += next(batches).num_graphs
        steps += 1
    wall = time.perf_counter() - started
    cpu = sum(_cpu_seconds(p) for p in pids) - cpu0
    del batches
    return {
        "task": dataset.manifest["task"], "budget": budget, "workers": workers,
        "path": "per-item" if per_item else "batch", "graphs_per_s": graphs / wall,
        "graphs_per_loader_cpu_s": graphs / cpu if cpu > 0 else float("nan"),
        "graphs_per_batch": graphs / steps, "batches": steps, "first_batch_s": first,
    }


def _one_rank(sampler):
    """The training loader's sampler of one worker taking one micro-batch per step (the stream of
    every batch of ``sampler``'s epochs, in order)."""
    from pipeline.train.global_batch import GlobalBatches, RankStream

    return RankStream(GlobalBatches(sampler, micro_batches_per_step=1), rank=0, world=1)


def line(r: dict) -> str:
    return (f"{r['task']} budget {r['budget']}, {r['workers']} loader worker(s), {r['path']} path: "
            f"{r['graphs_per_s']:,.0f} graphs/s, {r['graphs_per_loader_cpu_s']:,.0f} graphs per loader CPU-s "
            f"({r['graphs_per_batch']:.0f} graphs/batch, {r['batches']} batches, first batch {r['first_batch_s']:.2f} s)")


def _build_shards(base: Path) -> dict[str, Path]:
    """Small code2 and ppa shard directories with jobs/code2.yaml's and jobs/ppa.yaml's transforms."""
    import sysconfig

    from pipeline.config import load_job
    from pipeline.train.driver import prepare_data

    std = Path(sysconfig.get_paths()["stdlib"])
    out = {}
    for name, overrides in (
        ("code2", ["data.source=pycode", f"data.source_dirs={[str(std / p) for p in PACKAGES]}"]),
        ("ppa", ["data.source=synthetic", f"data.synthetic_graphs={PPA_GRAPHS}"]),
    ):
        job = load_job(ROOT / "jobs" / f"{name}.yaml",
                       [f"data.root={base / 'data'}", f"shards.root={base / 'shards'}", *overrides])
        out[name] = prepare_data(job)
    return out


def run() -> str:
    import ray

    rows = []
    with tempfile.TemporaryDirectory(prefix="satp-bench-loader-") as tmp:
        started = not ray.is_initialized()
        try:
            shards = _build_shards(Path(tmp))
        finally:
            if started and ray.is_initialized():
                ray.shutdown()
        for task, budget in (("code2", 131072), ("ppa", 16384), ("ppa", 65536)):
            for per_item in (True, False):
                rows.append(measure(shards[task], budget, workers=1, seconds=8.0, per_item=per_item))
                print(line(rows[-1]), flush=True)
    table = ["| data | budget | path | graphs/batch | graphs/s (1 loader worker) | graphs per loader CPU-s |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['task']} | {r['budget']} | {r['path']} | {r['graphs_per_batch']:.0f} | "
              f"{r['graphs_per_s']:,.0f} | {r['graphs_per_loader_cpu_s']:,.0f} |" for r in rows]
    return "\n".join([
        "### Loader: the training DataLoader alone (`python -m benchmarks.cpu.loader`)",
        f"Shards: {', '.join(PACKAGES)} of the standard library (code2) and {PPA_GRAPHS} synthetic ppa graphs, "
        "the jobs' transforms; one loader worker process (`--workers 1`), batches of the jobs' budgets. "
        "`per-item`: `ds[i]` per graph and `Batch.from_data_list` (the path before `ShardDataset.batch`).",
        "",
        *table,
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu.loader", description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True, help="a shard directory (its train split is read)")
    parser.add_argument("--budget", type=int, required=True, help="train.node_budget")
    parser.add_argument("--workers", type=int, required=True, help="train.loader_workers (0: in this process)")
    parser.add_argument("--job", help="job file (default: jobs/<task>.yaml of the shards' task)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measuring window after the first batch")
    parser.add_argument("--per-item", action="store_true", help="the per-item path, for comparison")
    args = parser.parse_args(argv)
    print(line(measure(args.shards, args.budget, args.workers, args.job, args.seconds, args.per_item)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
