"""GPU check, part ``steps`` (``benchmarks/gpu/run.sh steps``): what a training step costs, eager vs
compiled vs captured (``train.step``), and where ``satp train``'s start-up goes.

1. Step rows (:data:`ORDER`, :mod:`benchmarks.gpu.step` one process each, on shards of the jobs' layout):
   PATTERN at 32 and 128 random graphs per step, code2 at node budgets 16384 and 131072: graphs/s, wall
   ms per step against kernel ms (the target: step <= 1.25 x kernels), the share of batches over
   capacity, the warm-up (compilation and capture), peak GPU memory.
2. Start-up: one epoch of a small PATTERN (``train.step captured``) twice, the second with the compile
   caches the first left; the run's ``startup_*_s`` metrics from MLflow.

The step rows share their compile caches under ``runs/gpu-steps``, so a second call on the same warm
machine compiles nothing again. ``SATP_GPU_DRY_RUN=1``: tiny sizes and model on the CPU (``captured``
runs as ``compiled``: no CUDA graphs there).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks.gpu.measure import DRY_RUN, ROOT, Clock, _run, _step, device, out_dir

BUDGET_S = float(os.environ.get("SATP_GPU_BUDGET_S") or 510)
WORK = Path(os.environ.get("SATP_GPU_STEPS_DIR") or ROOT / "runs" / ("gpu-steps-dry" if DRY_RUN else "gpu-steps"))
PATTERN_GRAPHS = 64 if DRY_RUN else 4096
CODE2_GRAPHS = 64 if DRY_RUN else 8192
STARTUP_GRAPHS = 30 if DRY_RUN else 2000
STARTUP_STEP = "static" if DRY_RUN else "captured"  # CPU workers have no CUDA graphs
TIMING = dict(seconds=1.0, warmup=3, loader_workers=0, tiny=True) if DRY_RUN else dict(seconds=4.0, warmup=10,
                                                                                         loader_workers=4)


def _pattern(graphs: int) -> dict:
    return dict(job="jobs/pattern.yaml", graph_set="pattern", precision="bf16", node_budget=10**6,
                max_graphs=graphs, bucket_size=graphs)


def _code2(budget: int) -> dict:
    return dict(job="jobs/code2.yaml", graph_set="code2", precision="bf16", node_budget=budget)


CONFIGS = {"PATTERN, 32 graphs/step": _pattern(32), "PATTERN, 128 graphs/step": _pattern(128),
           "code2, budget 16384": _code2(16384), "code2, budget 131072": _code2(131072)}
# (configuration, step) in order of importance; the start-up runs after the first four
ORDER = [("PATTERN, 32 graphs/step", "eager"), ("PATTERN, 32 graphs/step", "captured"),
         ("code2, budget 16384", "eager"), ("code2, budget 16384", "captured"),
         ("PATTERN, 32 graphs/step", "compiled"), ("PATTERN, 128 graphs/step", "eager"),
         ("PATTERN, 128 graphs/step", "captured"), ("code2, budget 131072", "eager"),
         ("code2, budget 131072", "captured"), ("code2, budget 16384", "compiled"),
         ("PATTERN, 128 graphs/step", "compiled"), ("code2, budget 131072", "compiled")]
STARTUP_AFTER = 4


def shard_dirs(names: tuple[str, ...] = ("pattern", "code2")) -> dict[str, str]:
    """Shards of PATTERN- and code2-shaped graphs (of ``names``) in their jobs' layout
    (:func:`benchmarks.graphs.jobs.job_shards`); made once in :data:`WORK`, then reused."""
    from benchmarks.gpu.step import job_for
    from benchmarks.graphs.jobs import job_shards

    return {name: str(job_shards(job_for(CONFIGS[label]), WORK / f"{name}-{count}", count))
            for name, label, count in (("pattern", "PATTERN, 32 graphs/step", PATTERN_GRAPHS),
                                       ("code2", "code2, budget 16384", CODE2_GRAPHS)) if name in names}


def step_row(label: str, mode: str, files: dict, clock: Clock) -> dict:
    spec = dict(CONFIGS[label], **TIMING, step="compiled" if DRY_RUN and mode == "captured" else mode, detail=True)
    spec["shards"] = files[spec.pop("graph_set")]
    if DRY_RUN:
        spec["node_budget"] = min(spec["node_budget"], 2048)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(WORK / "compile-cache" / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(WORK / "compile-cache" / "triton")
    print(f"   steps: {label}, {mode} ...", flush=True)
    return _step(spec, min(300 if not DRY_RUN else 900, clock.left() - 20))


def startup(clock: Clock) -> dict:
    """Two one-epoch ``satp train`` runs of a small PATTERN (cold, then warm compile caches)."""
    from mlflow.tracking import MlflowClient

    data = WORK / "startup-data"
    if not (data / "sbm_pattern").is_dir():
        proc = _run([sys.executable, "-m", "pipeline.cli", "data", "sbm-pattern", "--out", str(data),
                     "--graphs", str(STARTUP_GRAPHS)], clock.left())
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "sbm-pattern failed"}
    tracking = f"sqlite:///{WORK / 'startup-mlflow.db'}"
    out = {}
    for attempt in ("cold", "warm"):
        if clock.left() < 90:
            out[attempt] = {"error": "skipped: GPU check time budget spent"}
            continue
        overrides = [f"data.root={data}", f"shards.root={WORK / 'startup-shards'}", "train.epochs=1",
                     f"train.step={STARTUP_STEP}",
                     f"train.storage_path={WORK / 'startup-ray'}", f"train.run_name=startup-{attempt}",
                     f"mlflow.tracking_uri={tracking}", "mlflow.experiment=gpu-steps-startup"]
        if DRY_RUN:
            overrides += ["resources.use_gpu=false", "resources.cpus_per_worker=1", "train.loader_workers=0",
                          "model.hidden_dim=16", "model.num_layers=1", "model.num_heads=2"]
        cmd = [sys.executable, "-m", "pipeline.cli", "train", "jobs/pattern.yaml", "--restart", "--no-progress"]
        for item in overrides:
            cmd += ["--set", item]
        print(f"   steps: start-up ({attempt}) ...", flush=True)
        proc = _run(cmd, clock.left() - 10)
        if proc.returncode != 0:
            out[attempt] = {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
            continue
        client = MlflowClient(tracking)
        run = client.search_runs([client.get_experiment_by_name("gpu-steps-startup").experiment_id],
                                 filter_string=f"tags.mlflow.runName = 'startup-{attempt}'")[0]
        out[attempt] = {k: v for k, v in run.data.metrics.items() if k.startswith("startup_")}
    return out


HEADER = ["| configuration | step | graphs/s | step ms | kernel ms / step | step / kernels | kernels / step "
          "| over capacity | warm-up s (compile, capture) | peak GPU mem (GB) |", "|---|---|---|---|---|---|---|---|---|---|"]


def _row(label: str, mode: str, r: dict) -> str:
    if "error" in r:
        return f"| {label} | {mode} | failed: {r['error'][-300:].replace('|', '/')} |" + " |" * 7
    busy = r.get("gpu_busy_ms_per_step")
    ratio = f"{r['step_ms'] / busy:.2f}" if busy else "-"
    busy_text = f"{busy:.1f}" if busy is not None else "-"
    kernels = f"{r['kernels_per_step']:,.0f}" if "kernels_per_step" in r else "-"
    return (f"| {label} | {mode} | **{r['graphs_per_s']:,.0f}** | {r['step_ms']:.1f} | {busy_text} | {ratio} | {kernels} "
            f"| {100 * r.get('overflow_share', 0):.1f}% | {r.get('warmup_s', 0):.0f} | {r['peak_mem_gb']:.2f} |")


def _startup_lines(result: dict) -> list[str]:
    from pipeline.train.startup import PHASES

    lines = ["", "Start-up of `satp train jobs/pattern.yaml` (one epoch, "
             f"{STARTUP_GRAPHS} graphs, `train.step` {STARTUP_STEP}), seconds per phase (`startup_<phase>_s` in MLflow):", "",
             "| run | " + " | ".join(phase.replace("_", " ") for _e, phase in PHASES) + " | to the first step |",
             "|---" * (len(PHASES) + 2) + "|"]
    for attempt, metrics in result.items():
        if "error" in metrics:
            lines.append(f"| {attempt} | failed: {metrics['error']} |")
            continue
        cells = [f"{metrics.get(f'startup_{phase}_s', float('nan')):.1f}" for _e, phase in PHASES]
        lines.append(f"| {attempt} caches | " + " | ".join(cells) + f" | **{metrics.get('startup_to_first_step_s', 0):.1f}** |")
    return lines


def run() -> str:
    clock = Clock(BUDGET_S)
    WORK.mkdir(parents=True, exist_ok=True)
    out = out_dir()
    raw: dict = {"rows": {}, "startup": None}
    files = shard_dirs()
    lines = ["### GPU check, part steps (`benchmarks/gpu/run.sh steps`): eager vs compiled vs captured steps", "",
             f"Device: {device()}; budget {BUDGET_S:.0f} s. {PATTERN_GRAPHS} PATTERN graphs, {CODE2_GRAPHS} "
             "code2-shaped graphs (`benchmarks/graphs/jobs.py`), bf16, the jobs' models; warm-up "
             f"{TIMING['warmup']} steps, then >= {TIMING['seconds']:g} s of whole steps; kernel ms: GPU busy time "
             "per step (torch.profiler, 3 steps).", ""] + HEADER
    for i, (label, mode) in enumerate(ORDER):
        if i == STARTUP_AFTER:
            raw["startup"] = startup(clock) if clock.left() > 120 else {"all": {"error": "skipped: budget spent"}}
        if clock.left() < 60:
            result = {"error": "skipped: GPU check time budget spent"}
        else:
            result = step_row(label, mode, files, clock)
        raw["rows"][f"{label} / {mode}"] = result
        print(f"   {json.dumps(result)[:400]}", flush=True)
        lines.append(_row(label, mode, result))
        if out is not None:
            (out / "gpu_steps.json").write_text(json.dumps(raw, indent=1, default=str))
    if raw["startup"] is not None:
        lines += _startup_lines(raw["startup"])
    lines += ["", f"Part wall time: {BUDGET_S - clock.left():.0f} s."]
    return "\n".join(lines)
