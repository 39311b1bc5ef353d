"""GPU check, part ``multirank`` (``benchmarks/gpu/run.sh multirank``): the multi-rank path on CUDA, once.

Two Ray Train workers share the one GPU (``resources.gpus_per_worker=0.5``: gloo, since NCCL refuses two
ranks on one device) on ``satp data pycode`` over the machine's standard library, ``jobs/code2.yaml``'s
model at node budget 16384: ``satp train`` for one epoch, then with ``train.epochs=2``, which resumes.
Checked from the run's files and the product's classes: every micro-batch of a step dealt to one rank
(:class:`pipeline.train.global_batch.GlobalBatches`) and the graphs the epoch reports equal to both
ranks' shares; DeepSpeed's step counter; the gathered validation and test metrics equal to a 1-rank
evaluation of the checkpoint's best weights (:meth:`pipeline.train.trainer.Trainer.evaluate_epoch`);
the resume (its log, epoch 0 kept, the same MLflow run, the step counter going on).

``python -m benchmarks.gpu.multirank --balance`` prints the per-rank work imbalance of node-budget
batches for several world sizes, ``--epoch-costs`` the per-epoch gather and checkpoint costs on this
machine (both for docs/scale.md; no GPU needed). ``SATP_GPU_DRY_RUN=1``: CPU workers, a tiny model,
150 graphs per split.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.gpu.measure import (DRY_RUN, ROOT, Clock, check_lines, device, measure, out_dir, overrides, pycode_data, satp,
                                    step_lines)
from pipeline.train.batching import split_sampler

BUDGET_S = float(os.environ.get("SATP_GPU_BUDGET_S") or 330)
GRAPHS_PER_SPLIT = int(os.environ.get("SATP_MULTIRANK_GRAPHS") or (150 if DRY_RUN else 3000))
WORK_DIR = Path(os.environ.get("SATP_MULTIRANK_DIR") or ROOT / "runs" / ("gpu-multirank-dry" if DRY_RUN else "gpu-multirank"))
JOB = "jobs/code2.yaml"
WORLD = 2


def _sets(run_name: str) -> list[str]:
    sets = [f"data.root={WORK_DIR / 'data'}", "data.source=pycode", f"data.max_graphs_per_split={GRAPHS_PER_SPLIT}",
            f"shards.root={WORK_DIR / 'shards'}", f"resources.num_workers={WORLD}", "resources.gpus_per_worker=0.5",
            "train.warmup_epochs=1", "train.node_budget=16384",
            f"train.storage_path={WORK_DIR / 'ray'}", f"mlflow.tracking_uri=sqlite:///{WORK_DIR / 'mlflow.db'}",
            f"train.run_name={run_name}"]
    if DRY_RUN:
        sets += ["resources.use_gpu=false", "resources.cpus_per_worker=1", "train.loader_workers=0",
                 "model.hidden_dim=32", "model.num_layers=1", "train.node_budget=2048", "train.eval_node_budget=4096"]
    else:
        sets += ["resources.cpus_per_worker=6"]  # 2 x 6 of 16 cores: the step and its 4 loader workers each
    return sets


def single_rank_eval(sets: list[str], shard_dir: str, checkpoint: Path, device) -> dict:
    """The checkpoint's best weights evaluated by the product's trainer in this process, rank 0 of 1
    (:class:`pipeline.train.context.LocalContext`): whole valid/test splits, the batches a 1-rank run
    cuts, the precision the trainer resolves on this machine."""
    import tempfile

    os.environ["DS_ACCELERATOR"] = device.type
    from pipeline.config import load_job
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.context import LocalContext
    from pipeline.train.loader import open_split
    from pipeline.train.plan import worker_setup
    from pipeline.train.trainer import Trainer

    state = ckpt.load_state(checkpoint)
    with tempfile.TemporaryDirectory(prefix="satp-multirank-eval-") as tmp:
        job = load_job(ROOT / JOB, sets + ["resources.num_workers=1", f"train.storage_path={tmp}", "mlflow.enabled=false"])
        (Path(tmp) / "run").mkdir()
        trainer = Trainer(worker_setup(job, shard_dir), LocalContext(Path(tmp) / "run", device))
        trainer.engine.module.load_state_dict(ckpt.load_best_weights(checkpoint))
        metrics = trainer.evaluate_epoch(state["best"]["epoch"])
    metric = trainer.task.metric
    return {"precision": trainer.precision, "best_epoch": state["best"]["epoch"], "metric": metric,
            **{split: {"score": metrics[f"{key}_{metric}"], "graphs": len(open_split(shard_dir, split))}
               for split, key in (("valid", "val"), ("test", "test"))}}


def _ds_counters(checkpoint: Path) -> dict:
    """DeepSpeed's counters in a checkpoint (rank 0's model-states file)."""
    import torch

    files = sorted((checkpoint / "ds").rglob("mp_rank_00_model_states.pt"))
    if not files:
        return {}
    state = torch.load(files[0], map_location="cpu", weights_only=False)
    return {k: state.get(k) for k in ("global_steps", "global_samples", "dp_world_size")}


def _latest(run_dir: Path) -> Path | None:
    from pipeline.train.checkpoint import CheckpointManager

    name = CheckpointManager(run_dir).newest_intact() if run_dir.is_dir() else None
    return run_dir / name if name is not None else None


def run() -> str:
    import torch

    from pipeline.config import load_job
    from pipeline.train.loader import open_split

    clock = Clock(BUDGET_S)
    out = out_dir()
    logs = WORK_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run_name = f"gpu-multirank-{time.strftime('%Y%m%d-%H%M%S')}"
    sets = _sets(run_name)
    job = load_job(ROOT / JOB, sets)
    raw: dict = {"run_name": run_name, "sets": sets, "backend": job.resources.torch_backend, "steps": {}}
    steps = raw["steps"]

    def save() -> None:
        if out is not None:
            (out / "gpu_multirank.json").write_text(json.dumps(raw, indent=1, default=str))

    lines = ["### GPU check, part multirank (`benchmarks/gpu/run.sh multirank`)", "",
             f"Device: {device()}; budget {BUDGET_S:.0f} s. `{JOB}` with `--set` "
             + " ".join(f"`{s}`" for s in sets if not s.startswith(("data.root", "shards.root", "train.storage",
                                                                   "mlflow.tracking")))
             + f" (paths under `{WORK_DIR}`): {WORLD} Ray Train workers, collectives: "
               f"**{job.resources.torch_backend}** (`resources.collective_backend: {job.resources.collective_backend}`).", ""]
    print(f"== gpu multirank: {run_name}, backend {job.resources.torch_backend} ({clock.left():.0f} s left)", flush=True)

    # data (reused on a warm machine) and shards
    steps["pycode"] = pycode_data(WORK_DIR, clock.left() * 0.3, logs)
    shard_dir = None
    if steps["pycode"]["ok"]:
        steps["preprocess"] = measure(satp("preprocess", JOB, "--no-progress", *overrides(sets)), clock.left() - 120,
                                      logs / "preprocess.log")
        shard_dir = steps["preprocess"]["tail"].strip() if steps["preprocess"]["ok"] else None
    save()
    run_dir = WORK_DIR / "ray" / run_name
    first = second = None
    for epochs, key in ((1, "train, epochs=1"), (2, "train, epochs=2 (resume)")):
        if not shard_dir or (epochs == 2 and not steps.get("train, epochs=1", {}).get("ok")):
            break
        if clock.left() < 60:
            steps[key] = {"ok": False, "skipped": "time budget spent"}
            break
        print(f"   satp train {key} ({clock.left():.0f} s left)", flush=True)
        steps[key] = measure(satp("train", JOB, *overrides(sets + [f"train.epochs={epochs}"])), clock.left() - 25,
                             logs / f"train-{epochs}.log")
        found = _latest(run_dir)
        if steps[key]["ok"] and found is not None:
            snapshot = {"checkpoint": str(found), "state": json.loads((found / "state.json").read_text()),
                        "deepspeed": _ds_counters(found)}
            if epochs == 1:
                first = snapshot
            else:
                second = snapshot
        save()

    lines += step_lines(steps)

    checks: list[tuple[str, bool, str]] = []
    if shard_dir and first is not None:
        train_ds = open_split(shard_dir, "train")
        sizes = np.asarray(train_ds.num_nodes)
        from pipeline.train.global_batch import GlobalBatches, share

        # the run's global batches, as every worker cuts them (the sequence of rank 0 of 1 is every rank's)
        plan = GlobalBatches(split_sampler(job, train_ds, True), job.train.micro_batches_per_step)
        steps, mine = plan.steps_per_epoch, [share(plan.micro_batches, r, WORLD) for r in range(WORLD)]
        history = (second or first)["state"]["history"]
        lines += ["", "Per rank and epoch (each rank's share of every step's micro-batches; graphs and node slots):", "",
                  "| epoch | micro-batches per rank | graphs per rank | nodes per rank | graphs reported (sum over ranks) |",
                  "|---|---|---|---|---|"]
        for h in history:
            epoch = int(h["epoch"])
            batches = [[plan.step(epoch, s)[j] for s in range(steps) for j in m] for m in mine]
            graphs = [sum(len(b) for b in bs) for bs in batches]
            nodes = [int(sum(sizes[b].sum() for b in bs)) for bs in batches]
            reported = round(h["graphs_per_s"] * h["epoch_seconds"])
            lines.append(f"| {epoch} | {' / '.join(map(str, (len(b) for b in batches)))} | "
                         f"{' / '.join(map(str, graphs))} | {' / '.join(f'{n:,}' for n in nodes)} | {reported:,} |")
            checks.append((f"epoch {epoch}: graphs reported = both ranks' micro-batches", reported == sum(graphs),
                           f"{reported} vs {sum(graphs)}"))
        checks.append(("every micro-batch of a step dealt to one rank (global batch)",
                       sorted(j for m in mine for j in m) == list(range(plan.micro_batches)), f"{[list(m) for m in mine]}"))
        steps_first = first["deepspeed"].get("global_steps")
        checks.append(("DeepSpeed steps after epoch 0 = steps per epoch", steps_first == steps,
                       f"{steps_first} vs {steps}; dp_world_size {first['deepspeed'].get('dp_world_size')}"))
        for split in ("valid", "test"):
            ds = open_split(shard_dir, split)
            counts = [len(split_sampler(job, ds, False, rank=r, world=WORLD)) for r in range(WORLD)]
            lines.append(f"\nEvaluation batches per rank, {split}: {' / '.join(map(str, counts))} "
                         f"({len(ds):,} graphs, gathered to rank 0)")
        if second is not None:
            log_text = Path(logs / "train-2.log").read_text() + Path(str(logs / "train-2.log") + ".err").read_text()
            h1, h2 = first["state"]["history"], second["state"]["history"]
            checks.append(("resume: the log says it resumed after epoch 0",
                           "resum" in log_text.lower() and "after epoch 0" in log_text, "`resuming run ... after epoch 0`"))
            checks.append(("resume: epoch 0 kept as the first run wrote it, epoch 1 added",
                           len(h2) == 2 and h2[0] == h1[0] and int(h2[1]["epoch"]) == 1, f"{len(h1)} -> {len(h2)} epochs"))
            checks.append(("resume: the same MLflow run", first["state"].get("mlflow_run_id") == second["state"].get("mlflow_run_id"),
                           str(second["state"].get("mlflow_run_id"))))
            steps_second = second["deepspeed"].get("global_steps")
            checks.append(("resume: DeepSpeed steps went on (2 x steps per epoch)", steps_second == 2 * steps,
                           f"{steps_first} -> {steps_second}"))
        final = second or first
        if clock.left() > 15:
            on = torch.device("cuda" if not DRY_RUN else "cpu")
            try:
                one = single_rank_eval(sets, shard_dir, Path(final["checkpoint"]), on)
                raw["single_rank_eval"] = one
                best = final["state"]["best"]
                metric = one["metric"]
                for split, reported in (("valid", best["val"]), ("test", best["test"])):
                    mine = one[split]["score"]
                    # same batches and weights; GPU atomics may reorder float sums: allow one graph's flip
                    tol = 1.0 / max(one[split]["graphs"], 1) + 1e-9
                    checks.append((f"gathered {split} {metric} (2 ranks) = 1-rank evaluation of the checkpoint",
                                   abs(mine - reported) <= tol,
                                   f"{reported:.6f} vs {mine:.6f} ({one[split]['graphs']:,} graphs, {one['precision']}, "
                                   f"best epoch {one['best_epoch']})"))
            except Exception as exc:  # the figures above must survive
                checks.append(("1-rank evaluation of the checkpoint", False, f"{type(exc).__name__}: {str(exc)[:300]}"))
        lines += ["", "| epoch | graphs/s (both ranks) | epoch s | data wait | eval s | train loss | val | test |",
                  "|---|---|---|---|---|---|---|---|"]
        metric = "f1"
        for h in history:
            lines.append(f"| {h['epoch']} | {h['graphs_per_s']:,.0f} | {h['epoch_seconds']:.1f} | "
                         f"{100 * h['data_wait_frac']:.1f}% | {h.get('eval_seconds', float('nan')):.1f} | "
                         f"{h['train_loss']:.3f} | {h.get(f'val_{metric}', float('nan')):.4f} | "
                         f"{h.get(f'test_{metric}', float('nan')):.4f} |")
    raw["checks"] = [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks]
    lines += check_lines(checks, f"part wall time {BUDGET_S - clock.left():.0f} s")
    if out is not None:
        for log in logs.glob("*.log*"):
            (out / f"multirank-{log.name}").write_text(log.read_text()[-20000:])
    save()
    return "\n".join(lines)


def rank_balance(sizes: np.ndarray, node_budget: int, world: int, epochs: int = 2, seed: int = 0,
                 bucket_size: int = 2048) -> dict:
    """Per-step imbalance of node-budget batches dealt to ``world`` ranks: for each step, the busiest
    rank's work over the mean rank's, for three measures of work (graphs, nodes, attention cells
    ``sum(n^2)``), averaged over the steps of ``epochs`` epochs. A synchronous step waits for its
    busiest rank, so ``mean(max/mean)`` is the time a step takes against perfectly balanced work
    where the step time is proportional to that measure."""
    from pipeline.train.batching import NodeBudgetSampler
    from pipeline.train.global_batch import GlobalBatches

    sampler = NodeBudgetSampler(sizes, node_budget, seed=seed, bucket_size=bucket_size)
    dealt = GlobalBatches(sampler, world)  # a step of one micro-batch per rank, as a run of ``world`` ranks deals them
    ratios: dict[str, list[float]] = {"graphs": [], "nodes": [], "attention": []}
    started = time.perf_counter()
    sampler.global_batches(epochs)  # an epoch's cut, timed (every rank makes it when its epoch starts)
    cut_s = time.perf_counter() - started
    for epoch in range(epochs):
        for step in range(dealt.steps_per_epoch):
            batches = dealt.step(epoch, step)
            for key, work in (("graphs", [len(b) for b in batches]),
                              ("nodes", [int(sizes[b].sum()) for b in batches]),
                              ("attention", [int((sizes[b].astype(np.int64) ** 2).sum()) for b in batches])):
                ratios[key].append(max(work) / (sum(work) / world))
    steps = len(ratios["graphs"]) // epochs
    return {"steps_per_epoch": steps, "cut_s": cut_s, **{k: float(np.mean(v)) for k, v in ratios.items()}}


def _balance_table() -> str:
    """Code2-shaped sizes (ogbg-code2's node counts as a lognormal: mean 125, sigma 0.75, 10-1000), its
    train split (407,976 graphs)."""
    rng = np.random.default_rng(0)
    sizes = np.clip(rng.lognormal(np.log(125) - 0.75 ** 2 / 2, 0.75, 407_976), 10, 1000).astype(np.int64)
    lines = ["| node budget | ranks | steps per epoch | graphs max/mean | nodes max/mean | attention cells max/mean "
             "| one epoch's batch cut (s, this CPU) |", "|---|---|---|---|---|---|---|"]
    for budget in (16384, 131072):
        for world in (1, 8, 32):
            r = rank_balance(sizes, budget, world)
            lines.append(f"| {budget} | {world} | {r['steps_per_epoch']:,} | {r['graphs']:.3f} | {r['nodes']:.3f} "
                         f"| {r['attention']:.3f} | {r['cut_s']:.2f} |")
    return "\n".join(lines)


def epoch_costs(graphs: int = 100_000, seed: int = 0) -> dict:
    """Per-epoch costs of a run that grow with the ranks, measured on this machine with the code2 task:

    - the gathers (``pipeline.train.metrics.gather_objects``: ``all_gather_object`` of each rank's
      ``(predictions, targets)``): pickling a rank's lists, unpickling every rank's (each rank
      receives all), and OGB's F1 over them on rank 0; per graph, from ``graphs`` made-up entries
      shaped like pycode's (1-3 target subtokens, mean ~1.7; 1-5 predicted; 3-8 letters each);
    - one checkpoint of ``jobs/code2.yaml``'s model as a run writes it: the product's trainer on this
      CPU after one step (AdamW's state filled), its ``Reports.write`` (DeepSpeed's engine state, the
      best weights, ``state.json``, the copy into the run's storage with its digests): seconds and MB.
    """
    import pickle
    import shutil
    import tempfile

    import torch

    from benchmarks.gpu.step import job_for
    from benchmarks.graphs.jobs import job_shards
    from pipeline.tasks import Code2Task
    from pipeline.train.context import LocalContext
    from pipeline.train.plan import worker_setup
    from pipeline.train.trainer import Trainer

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def word() -> str:
        return "".join(rng.choice(letters, size=int(rng.integers(3, 9))))

    words = [word() for _ in range(5000)]
    # targets are read from the shards (a string object each); predictions are decoded from the
    # vocabulary (the vocabulary's own objects, which pickle stores once)
    targets = [[(words[i] + " ")[:-1] for i in rng.integers(0, 5000, size=int(rng.choice([1, 2, 3], p=[0.5, 0.35, 0.15])))]
               for _ in range(graphs)]
    preds = [[words[i] for i in rng.integers(0, 5000, size=int(rng.integers(1, 6)))] for _ in range(graphs)]
    out: dict = {"graphs": graphs}
    started = time.perf_counter()
    blob = pickle.dumps((preds, targets))
    out["pickle_us_per_graph"] = 1e6 * (time.perf_counter() - started) / graphs
    out["bytes_per_graph"] = len(blob) / graphs
    started = time.perf_counter()
    pickle.loads(blob)
    out["unpickle_us_per_graph"] = 1e6 * (time.perf_counter() - started) / graphs
    task = Code2Task(words + ["__UNK__", "__EOS__"])
    started = time.perf_counter()
    task.score(preds, targets)
    out["f1_us_per_graph"] = 1e6 * (time.perf_counter() - started) / graphs

    class OneStep(Exception):
        pass

    def stop(trainer, global_step: int) -> None:
        raise OneStep

    work = Path(tempfile.mkdtemp(prefix="satp-ckpt-probe-"))
    try:
        spec = {"job": "jobs/code2.yaml", "max_graphs": 4, "bucket_size": 4, "loader_workers": 0, "precision": "fp32"}
        job = job_for(spec, work)
        (work / "run").mkdir()
        on = torch.device("cuda", 0) if torch.cuda.is_available() else None
        trainer = Trainer(worker_setup(job, job_shards(job, work / "shards", 8)), LocalContext(work / "run", on),
                          on_step=stop)
        try:
            trainer.train_epoch(0)
        except OneStep:
            pass
        out["parameters"] = sum(p.numel() for p in trainer.engine.module.parameters() if p.requires_grad)
        best = {k: v.detach().float().cpu().clone() for k, v in trainer.engine.module.state_dict().items()}
        started = time.perf_counter()
        name = trainer.reports.write(trainer.state, best, {}, 0)
        out["checkpoint_seconds"] = time.perf_counter() - started
        out["checkpoint_mb"] = sum(f.stat().st_size for f in (work / "run" / name).rglob("*") if f.is_file()) / 1e6
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--balance"]:
        print(_balance_table())
    elif sys.argv[1:] == ["--epoch-costs"]:
        print(json.dumps(epoch_costs(), indent=1))
    else:
        print(run())
