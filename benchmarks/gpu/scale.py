"""GPU check, part ``scale`` (``benchmarks/gpu/run.sh scale``): the pipeline at ogbg-ppa's size on one GPU.

In ``SATP_GPU_SCALE_DIR`` (default ``runs/gpu-scale``, kept between calls on a warm machine): ``satp data
synthetic-ppa`` of ``N = SATP_SCALE_GRAPHS`` graphs (default 158,100, the real dataset's size; lowered to
what the free disk holds at :data:`DISK_PER_GRAPH`; reused when the folder holds the same N), ``satp
preprocess jobs/ppa.yaml`` on it (finished shards reused), then one epoch of ``satp train jobs/ppa.yaml``
on one GPU worker, evaluation and registration included (``train.train_subset`` / ``eval_subset`` cut
it when the time left cannot hold it by the estimate of :func:`_fit_epoch`). Per command:
:func:`benchmarks.gpu.measure.measure`'s wall time and memory, and the disk after it; the epoch's
figures from MLflow. ``SATP_GPU_DRY_RUN=1``: 300 graphs, a tiny model, CPU workers.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from benchmarks.gpu.measure import (DRY_RUN, ROOT, Clock, _pipeline_metrics, device, disk_gb, measure, out_dir, overrides, satp,
                                    step_lines)

FULL_GRAPHS = 158_100
# a comma list (benchmarks/scale/data_path.py's form of the same variable) gives its largest size
GRAPHS = max(int(v) for v in (os.environ.get("SATP_SCALE_GRAPHS") or str(300 if DRY_RUN else FULL_GRAPHS)).split(",")
             if v.strip())
BUDGET_S = float(os.environ.get("SATP_GPU_BUDGET_S") or 510)
WORKERS = min(16, os.cpu_count() or 1)
SCALE_DIR = Path(os.environ.get("SATP_GPU_SCALE_DIR") or ROOT / "runs" / ("gpu-scale-dry" if DRY_RUN else "gpu-scale"))
JOB = "jobs/ppa.yaml"
# disk per graph (bytes): raw gzip CSVs and shards from a 1/10-size run (613 MB, 2.4 GB for
# 15,810 graphs); the columnar raw store from its layout (2 x int32 ids + 7 x float32 per edge, 2,266
# edges per graph)
DISK_PER_GRAPH = 39e3 + 152e3 + 2266 * (8 + 28)
# the epoch estimate that sizes train/eval subsets when time is short: the ppa step benchmark's 1,629
# graphs/s at budget 16384 (H200) less a margin, evaluation (budget 65536, no backward)
# assumed 3x faster, and ~80 s of Ray start, worker start, checkpoint and registration around the epoch
TRAIN_GRAPHS_PER_S, EVAL_GRAPHS_PER_S, TRAIN_FIXED_S = 1300.0, 4000.0, 80.0


def _sets(graphs: int) -> list[str]:
    data = SCALE_DIR / "data"
    sets = [f"data.root={data}", "data.source=synthetic", f"data.synthetic_graphs={graphs}",
            f"shards.root={SCALE_DIR / 'shards'}"]
    if DRY_RUN:
        sets += ["resources.use_gpu=false", "resources.cpus_per_worker=2", "train.loader_workers=1",
                 "model.hidden_dim=32", "model.num_layers=1", "train.node_budget=4096", "train.eval_node_budget=8192"]
    return sets


def _split_sizes(shard_dir: str) -> dict[str, int]:
    from pipeline.train.loader import open_split

    return {s: len(open_split(shard_dir, s)) for s in ("train", "valid", "test")}


def _fit_epoch(sizes: dict[str, int], left: float) -> tuple[int | None, int | None, float]:
    """``(train_subset, eval_subset, estimated seconds)``: the whole splits when the estimate fits
    ``left`` seconds, else subsets cut in the same proportion."""
    train, evals = sizes["train"], sizes["valid"] + sizes["test"]
    need = train / TRAIN_GRAPHS_PER_S + evals / EVAL_GRAPHS_PER_S
    room = left - TRAIN_FIXED_S
    if need <= room:
        return None, None, TRAIN_FIXED_S + need
    share = max(room, 10.0) / need
    return (max(1, int(train * share)), max(1, int(max(sizes["valid"], sizes["test"]) * share)),
            TRAIN_FIXED_S + need * share)


def run() -> str:
    clock = Clock(BUDGET_S)
    out = out_dir()
    SCALE_DIR.mkdir(parents=True, exist_ok=True)
    logs = SCALE_DIR / "logs"
    logs.mkdir(exist_ok=True)
    raw: dict = {"graphs_asked": GRAPHS, "budget_s": BUDGET_S, "workers": WORKERS, "dir": str(SCALE_DIR), "steps": {}}

    def save() -> None:
        if out is not None:
            (out / "gpu_scale.json").write_text(json.dumps(raw, indent=1, default=str))

    graphs = GRAPHS
    free = shutil.disk_usage(SCALE_DIR).free
    data = SCALE_DIR / "data"
    marker = SCALE_DIR / "graphs.txt"
    reuse = (data / "ogbg_ppa").is_dir() and marker.is_file() and marker.read_text().strip() == str(graphs)
    notes = []
    if not reuse:
        fits = int(free * 0.9 / DISK_PER_GRAPH)
        if fits < graphs:
            notes.append(f"{graphs:,} graphs would need ~{graphs * DISK_PER_GRAPH / 1e9:.0f} GB of disk "
                         f"({DISK_PER_GRAPH / 1e3:.0f} KB per graph), {free / 1e9:.0f} GB free: lowered to {fits:,}")
            graphs = fits
    raw.update(graphs=graphs, free_disk_gb_before=free / 1e9, reused_data=reuse)
    sets = _sets(graphs)
    lines = ["### GPU check, part scale (`benchmarks/gpu/run.sh scale`)", "",
             f"Device: {device()}; budget {BUDGET_S:.0f} s; "
             f"**{graphs:,} synthetic ogbg-ppa graphs** (`SATP_SCALE_GRAPHS`; ogbg-ppa has {FULL_GRAPHS:,}); "
             f"work directory `{SCALE_DIR}` ({free / 1e9:.0f} GB free at the start).", ""]
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    steps: dict[str, dict] = raw["steps"]
    print(f"== gpu scale: {graphs} graphs in {SCALE_DIR} ({clock.left():.0f} s left)", flush=True)

    # 1. the data
    gen = satp("data", "synthetic-ppa", "--out", str(data), "--graphs", str(graphs), "--workers", str(WORKERS))
    if reuse:
        steps["generate"] = {"skipped": "reused the data of an earlier call (same N)"}
    else:
        if data.exists():
            shutil.rmtree(data)
        marker.unlink(missing_ok=True)
        print(f"   {' '.join(gen)}", flush=True)
        steps["generate"] = measure(gen, clock.left() * 0.45, logs / "generate.log")
        if steps["generate"]["ok"]:
            marker.write_text(str(graphs))
    steps["generate"]["disk_gb"] = disk_gb(data)
    save()

    # 2. the shards
    pre = satp("preprocess", JOB, "--no-progress", *overrides(sets))
    shard_dir = None
    if (data / "ogbg_ppa").is_dir() and (reuse or steps["generate"].get("ok")):
        print(f"   satp preprocess ({clock.left():.0f} s left)", flush=True)
        steps["preprocess"] = measure(pre, clock.left() - 60, logs / "preprocess.log")
        if steps["preprocess"]["ok"]:
            shard_dir = steps["preprocess"]["tail"].strip()
    else:
        steps["preprocess"] = {"skipped": "no data"}
    steps["preprocess"]["disk_gb"] = disk_gb(SCALE_DIR / "shards")
    steps["preprocess"]["columnar_disk_gb"] = disk_gb(data / "ogbg_ppa" / "columnar")
    save()

    # 3. one epoch on one GPU worker
    run_name = f"gpu-scale-{time.strftime('%Y%m%d-%H%M%S')}"
    tracking = f"sqlite:///{SCALE_DIR / 'mlflow.db'}"
    train_sets = sets + ["resources.num_workers=1", "train.micro_batches_per_step=1", "train.epochs=1", "train.warmup_epochs=1",
                         f"train.storage_path={SCALE_DIR / 'ray'}", f"mlflow.tracking_uri={tracking}",
                         f"train.run_name={run_name}"]
    sizes, epochs = {}, []
    if shard_dir and clock.left() > TRAIN_FIXED_S + 20:
        sizes = _split_sizes(shard_dir)
        train_subset, eval_subset, estimate = _fit_epoch(sizes, clock.left() - 15)
        if train_subset is not None:
            train_sets += [f"train.train_subset={train_subset}", f"train.eval_subset={eval_subset}"]
            lines += [f"- the epoch cut to fit the time left ({clock.left():.0f} s): train.train_subset="
                      f"{train_subset:,} of {sizes['train']:,}, train.eval_subset={eval_subset:,} per split", ""]
        raw.update(split_sizes=sizes, train_subset=train_subset, eval_subset=eval_subset, epoch_estimate_s=estimate)
        print(f"   satp train, 1 epoch ({clock.left():.0f} s left; estimate {estimate:.0f} s)", flush=True)
        steps["train"] = measure(satp("train", JOB, *overrides(train_sets)), clock.left() - 10, logs / "train.log")
        if steps["train"]["ok"]:
            epochs = _pipeline_metrics(tracking, run_name, "acc")
    else:
        steps["train"] = {"skipped": "no shards" if not shard_dir else "time budget spent"}
    steps["train"]["disk_gb"] = sum(disk_gb(SCALE_DIR / d) for d in ("ray", "mlflow.db", "mlartifacts"))
    raw["epochs"] = epochs
    raw["free_disk_gb_after"] = shutil.disk_usage(SCALE_DIR).free / 1e9
    save()

    # the section
    lines += [f"Commands (in `{SCALE_DIR}`; `--set` {' '.join('`' + s + '`' for s in sets)}):", "",
              f"1. `satp data synthetic-ppa --out DIR/data --graphs {graphs} --workers {WORKERS}`",
              f"2. `satp preprocess {JOB} --no-progress --set ...`",
              f"3. `satp train {JOB} --set ... --set resources.num_workers=1 --set train.micro_batches_per_step=1 --set train.epochs=1 "
              f"--set train.warmup_epochs=1` (one GPU worker, evaluation, checkpoint, registration)", ""]
    lines += step_lines({"1. synthetic-ppa": steps["generate"], "2. preprocess": steps["preprocess"],
                         "3. train, 1 epoch": steps["train"]},
                        {"1. synthetic-ppa": f"{steps['generate']['disk_gb']:.2f} (raw + columnar: "
                                             f"{steps['preprocess']['columnar_disk_gb']:.2f} after step 2)",
                         "2. preprocess": f"{steps['preprocess']['disk_gb']:.2f} (shards)",
                         "3. train, 1 epoch": f"{steps['train']['disk_gb']:.2f} (checkpoints, MLflow)"})
    if steps["generate"].get("ok"):
        lines += ["", f"Generator output: `{steps['generate']['tail'][:400]}`"]
    if epochs:
        e = epochs[-1]
        trained = raw.get("train_subset") or sizes.get("train", 0)
        lines += ["", "The epoch, as the pipeline logged it (MLflow, Ray Train's controller):", "",
                  "| train graphs | graphs/s | epoch s | data wait | eval s | train loss | val acc | test acc |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {trained:,} | **{e.get('graphs_per_s', float('nan')):,.0f}** | {e.get('epoch_seconds', float('nan')):.1f} "
                  f"| {100 * e.get('data_wait_frac', float('nan')):.1f}% | {e.get('eval_seconds', float('nan')):.1f} "
                  f"| {e.get('train_loss', float('nan')):.3f} | {e.get('val_acc', float('nan')):.4f} "
                  f"| {e.get('test_acc', float('nan')):.4f} |"]
        other = steps["train"]["seconds"] - e.get("epoch_seconds", 0.0) - e.get("eval_seconds", 0.0)
        lines += ["", f"`satp train` besides the epoch and its evaluation (Ray and worker start, data opening, "
                      f"checkpoint, registration): {other:.0f} s."]
    rates = []
    for key, label in (("generate", "generation"), ("preprocess", "preprocessing")):
        r = steps[key]
        if r.get("ok") and graphs:
            rates.append(f"{label} {1e3 * r['seconds'] / graphs:.2f} ms per graph "
                         f"(x {FULL_GRAPHS:,} = {r['seconds'] * FULL_GRAPHS / graphs:.0f} s at full size)")
    if rates and graphs != FULL_GRAPHS:
        lines += ["", "Per graph, linear extrapolation (wall time x 158,100 / N; fixed costs make it an upper "
                      "bound): " + "; ".join(rates) + "."]
    lines += ["", f"Free disk: {free / 1e9:.1f} GB before, {raw['free_disk_gb_after']:.1f} GB after; "
                  f"part wall time {BUDGET_S - clock.left():.0f} s."]
    if out is not None:
        for log in logs.glob("*.log*"):
            (out / f"scale-{log.name}").write_text(log.read_text()[-20000:])
    save()
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
