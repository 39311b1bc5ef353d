"""Training benchmark (`make bench`, area `training`): graphs/s with 1 and 2 Ray Train workers on CPU
(DeepSpeed, bf16 where supported), the share of step time spent waiting for data, and the padding
waste of the node-budget batches (dense attention cells).

Data: the offline Python-source dataset of `jobs/code2-local.yaml`'s kind, restricted to a few
standard-library packages so the run takes a couple of minutes; model and batching from
`jobs/code2-local.yaml`. Padding is also reported on code2-shaped synthetic sizes (ogbg-code2's
node counts as a lognormal: mean 125, sigma 0.75, clipped to [10, 1000], seed 0) at the paper job's node budget.
"""
from __future__ import annotations

import os
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncio", "multiprocessing", "email", "idlelib", "tkinter")
EPOCHS = 2


def padding_stats(batches: list[np.ndarray], sizes: np.ndarray) -> dict[str, float]:
    """Share of padded node slots and of padded attention cells over ``batches``."""
    slots = used_slots = cells = used_cells = 0
    for b in batches:
        s = sizes[b].astype(np.int64)
        m = int(s.max())
        slots += len(s) * m
        used_slots += int(s.sum())
        cells += len(s) * m * m
        used_cells += int((s * s).sum())
    return {
        "node_padding": 1.0 - used_slots / max(slots, 1),
        "attention_padding": 1.0 - used_cells / max(cells, 1),
        "batches": float(len(batches)),
    }


def _job(base: Path, workers: int):
    import yaml

    from pipeline.config import JobConfig

    raw = yaml.safe_load((ROOT / "jobs" / "code2-local.yaml").read_text())
    std = Path(sysconfig.get_paths()["stdlib"])
    raw["data"].update(root=str(base / "data"), source_dirs=[str(std / p) for p in PACKAGES], max_graphs_per_split=None)
    raw["shards"]["root"] = str(base / "shards")
    raw["train"].update(epochs=EPOCHS, storage_path=str(base / "ray"), run_name=f"bench-{workers}w", eval_every=EPOCHS)
    raw["resources"]["num_workers"] = workers
    raw["mlflow"]["enabled"] = False
    return JobConfig.model_validate(raw)


def _synthetic_padding(node_budget: int) -> dict:
    from pipeline.train.batching import NodeBudgetSampler

    rng = np.random.default_rng(0)
    sizes = np.clip(rng.lognormal(np.log(125) - 0.75**2 / 2, 0.75, 20000), 10, 1000).astype(int)
    sampler = NodeBudgetSampler(sizes, node_budget, seed=0)
    return padding_stats(sampler.epoch_batches(0), sizes)


def run() -> str:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import ray

    from pipeline.train.batching import NodeBudgetSampler
    from pipeline.train.driver import prepare_data, train_job
    from pipeline.train.loader import open_split

    lines = []
    with tempfile.TemporaryDirectory(prefix="satp-bench-") as tmp:
        base = Path(tmp)
        started = not ray.is_initialized()
        if started:
            from runtime.ray_cluster import init_local_ray

            init_local_ray(num_cpus=2, dashboard=False, log_to_driver=False, env_vars={"DS_ACCELERATOR": "cpu"})
        try:
            job1 = _job(base, 1)
            shards = prepare_data(job1)
            train = open_split(shards, "train")
            sizes = np.asarray(train.num_nodes)
            pad = padding_stats(NodeBudgetSampler(sizes, job1.train.node_budget, seed=0).epoch_batches(0), sizes)
            results = {}
            for workers in (1, 2):
                t0 = time.time()
                out = train_job(_job(base, workers), shard_dir=shards, register=False)
                last = out.history[-1]
                results[workers] = (last["graphs_per_s"], last["data_wait_frac"], time.time() - t0, out.best["test"])
        finally:
            if started:
                ray.shutdown()
    syn = _synthetic_padding(4096)
    job = _job(Path("/tmp"), 1)
    lines.append("### Training (Ray Train V2 + DeepSpeed, CPU)")
    lines.append("")
    lines.append("Command: `BENCH=training make bench`. Data: offline Python-source dataset "
                 f"({', '.join(PACKAGES)} from the stdlib; {len(sizes)} train graphs, mean {sizes.mean():.0f} nodes). "
                 f"Model/batching of `jobs/code2-local.yaml` (hidden {job.model.hidden_dim}, {job.model.num_layers} layers, "
                 f"node budget {job.train.node_budget}), precision {job.train.precision}, ZeRO {job.train.zero_stage}; "
                 f"figures of epoch {EPOCHS - 1} (warm), 1 CPU per worker.")
    lines.append("")
    lines.append("| workers | train graphs/s | data wait (share of step time) | fit wall time (s) | test F1 |")
    lines.append("|---|---|---|---|---|")
    for w, (gps, wait, wall, f1) in results.items():
        lines.append(f"| {w} | {gps:.1f} | {100 * wait:.1f}% | {wall:.0f} | {f1:.4f} |")
    lines.append("")
    lines.append(f"Scaling 1 -> 2 workers: {results[2][0] / results[1][0]:.2f}x graphs/s (2 cores in all).")
    lines.append("")
    lines.append("| batches | padded node slots | padded attention cells | batches/epoch |")
    lines.append("|---|---|---|---|")
    lines.append(f"| pycode train split, budget {job.train.node_budget} | {100 * pad['node_padding']:.1f}% | "
                 f"{100 * pad['attention_padding']:.1f}% | {pad['batches']:.0f} |")
    lines.append(f"| code2-shaped synthetic (20k graphs), budget 4096 | {100 * syn['node_padding']:.1f}% | "
                 f"{100 * syn['attention_padding']:.1f}% | {syn['batches']:.0f} |")
    lines.append("")
    lines.append("Targets: data wait < 5% of step time; padding < 15% of attention cells.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
