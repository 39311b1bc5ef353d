"""Batch-size study (issue 20, "time to accuracy"): ``BENCH=batch .venv/bin/python -m benchmarks.run``
(or ``python -m benchmarks.bench_batch``, which prints the section without appending it).

The question: the GPU job's global batch (~2,070 graphs per step over 4 workers, 65x the paper's 32)
with a learning rate from the square-root rule. Here, on CPU, with the model of ``jobs/code2-local.yaml``
on the offline Python-source data, for global batches of G graphs (``SATP_BATCH_SIZES``, default
32,128,512,2048):

1. an ASHA sweep of ``train.lr`` per G through the product's own machinery (``satp tune`` on a job
   made from ``jobs/code2-batch-local.yaml``: one Ray Train worker per trial, ``max_graphs_per_batch: G``
   and ``bucket_size: G`` so that every step takes G random graphs), the grid
   ``SATP_BATCH_LR_FACTORS`` x lr_32 x sqrt(G / 32) (the square-root rule's value first, so that ASHA
   compares the others with it);
2. the sweep's best lr again with the seeds ``SATP_BATCH_SEEDS`` (default 1,2; the sweep's trial is
   seed 0) through ``satp compare`` (variants x seeds, no scheduler);
3. from the trials' Train checkpoints (``state.json`` history: ``val_f1``, ``test_f1``, ``steps``,
   ``elapsed_s`` per epoch): the table, F1 against wall-clock and against optimizer steps
   (``docs/figures/batch_f1_vs_time.png``, ``docs/figures/batch_f1_vs_steps.png``), the steps and
   seconds to a validation F1 that every batch size reaches, and the critical batch size.

Every G trains on the same graphs for the same epochs (``SATP_BATCH_TRAIN`` training functions,
``SATP_BATCH_EPOCHS`` epochs; a cosine schedule with a warm-up of 10% of training), so a larger G takes
proportionally fewer steps. The sizes run in ``SATP_BATCH_LANES`` (default 2) lanes side by side, one
CPU each: each lane runs the sweep and then the seeds of its sizes, one trial at a time.

Everything lives under ``SATP_BATCH_DIR`` (default ``runs/batch-study``): the dataset (built once by
``satp data pycode``), the shards, the generated job files, the Tune / Train storage, one MLflow SQLite
database per lane (experiment ``satp-batch-study``) and the logs. A rerun with the same settings finds
the finished sweeps and comparisons (the product's reruns: nothing trains again) and only reports;
``SATP_BATCH_REPORT_ONLY=1`` reports from what is there without running anything.

Critical batch size: with S(G) the optimizer steps to the common validation F1 target, perfect
scaling gives S(4G) = S(G) / 4 (the sizes are 4x apart). The empirical model of McCandlish et al.
(2018), S(G) = S_min (1 + G_crit / G), is fitted by least squares of S on 1/G; G_crit is the batch at
which twice the minimal number of steps is needed (and twice the minimal number of graphs seen), i.e.
beyond which doubling the batch saves less than a third of the steps.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.bench_scale import cpu_model

ROOT = Path(__file__).resolve().parent.parent
BASE_JOB = ROOT / "jobs" / "code2-batch-local.yaml"
FIGURES = ROOT / "docs" / "figures"
EXPERIMENT = "satp-batch-study"
WARMUP_FRACTION = 0.1
MAX_NODES_FALLBACK = 2560


# ----------------------------------------------------------------------------- settings
def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def _floats(text: str) -> list[float]:
    return [float(s) for s in text.split(",") if s.strip()]


def settings() -> dict[str, Any]:
    env = os.environ.get
    return {
        "sizes": _ints(env("SATP_BATCH_SIZES", "32,128,512,2048")),
        "train_graphs": int(env("SATP_BATCH_TRAIN", "4096")),
        "epochs": int(env("SATP_BATCH_EPOCHS", "4")),
        "eval_subset": int(env("SATP_BATCH_EVAL", "1000")),
        "lr32": float(env("SATP_BATCH_LR32", "2e-3")),
        "lr_factors": _floats(env("SATP_BATCH_LR_FACTORS", "1,0.5,2")),
        "seeds": _ints(env("SATP_BATCH_SEEDS", "1,2")),
        "grace": int(env("SATP_BATCH_GRACE", "1")),
        "lanes": max(1, int(env("SATP_BATCH_LANES", "2"))),
        "dir": Path(env("SATP_BATCH_DIR", str(ROOT / "runs" / "batch-study"))).resolve(),
        "report_only": env("SATP_BATCH_REPORT_ONLY", "0") not in ("", "0", "false"),
        "figures": Path(env("SATP_BATCH_FIGURES", str(FIGURES))).resolve(),
    }


def sqrt_rule_lr(lr32: float, graphs: int) -> float:
    return lr32 * math.sqrt(graphs / 32)


def lr_grid(cfg: dict, graphs: int) -> list[float]:
    return [float(f"{sqrt_rule_lr(cfg['lr32'], graphs) * f:.4g}") for f in cfg["lr_factors"]]


def lanes_of(sizes: list[int], lanes: int) -> list[list[int]]:
    """Sizes dealt to lanes so that each lane gets a large and a small one (largest first)."""
    order = sorted(sizes, reverse=True)
    out: list[list[int]] = [[] for _ in range(min(lanes, len(order)))]
    for i, g in enumerate(order):
        k = i % (2 * len(out))
        out[k if k < len(out) else 2 * len(out) - 1 - k].append(g)
    return [lane for lane in out if lane]


# ----------------------------------------------------------------------------- job files
def _load_base() -> dict:
    import yaml

    return yaml.safe_load(BASE_JOB.read_text())


def shard_dirs(cfg: dict) -> list[Path]:
    """The study's finished shard directories, the most recently written last."""
    found = [p.parent for p in (cfg["dir"] / "shards").glob("ogbg-code2-*/manifest.json")]
    return sorted(found, key=lambda p: (p / "manifest.json").stat().st_mtime)


def max_graph_nodes(cfg: dict) -> int:
    """The largest training graph (from the shards when they exist, else a bound for the stdlib corpus)."""
    try:
        import numpy as np

        from pipeline.train.loader import open_split

        shards = shard_dirs(cfg)
        if shards:
            return int(np.max(np.asarray(open_split(shards[-1], "train").num_nodes)))
    except Exception:
        pass
    return MAX_NODES_FALLBACK


def base_dict(cfg: dict, graphs: int, lane: int) -> dict:
    """The job of one batch size: paths under the study directory, G, the budget, warm-up 10%."""
    d = cfg["dir"]
    raw = _load_base()
    raw.pop("tune", None)
    raw["name"] = f"code2-batch-g{graphs}"
    raw["data"]["root"] = str(d / "data")
    raw["data"]["max_graphs_per_split"] = cfg["train_graphs"]
    raw["shards"]["root"] = str(d / "shards")
    t = raw["train"]
    t["epochs"] = cfg["epochs"]
    t["warmup_epochs"] = round(WARMUP_FRACTION * cfg["epochs"], 4)
    t["max_graphs_per_batch"] = graphs
    t["bucket_size"] = graphs
    t["node_budget"] = max(int(t["node_budget"]), graphs * (max_graph_nodes(cfg) + 48))
    t["eval_subset"] = cfg["eval_subset"]
    t["lr"] = sqrt_rule_lr(cfg["lr32"], graphs)
    t["storage_path"] = str(d / "ray")
    raw["mlflow"]["tracking_uri"] = f"sqlite:///{d / f'mlflow-lane{lane}.db'}"
    raw["mlflow"]["experiment"] = EXPERIMENT
    return raw


def sweep_name(graphs: int) -> str:
    return f"code2-batch-g{graphs}"


def seeds_name(graphs: int) -> str:
    return f"code2-batch-g{graphs}-seeds"


def sweep_job(cfg: dict, graphs: int, lane: int) -> dict:
    raw = base_dict(cfg, graphs, lane)
    raw["tune"] = {
        "name": sweep_name(graphs),
        "storage_path": str(cfg["dir"] / "tune"),
        "num_samples": 1,
        "metric": "val_f1",
        "mode": "max",
        "max_concurrent_trials": 1,
        "seed": 0,
        "register_best": False,
        "asha": {"grace_period": cfg["grace"], "reduction_factor": 2, "max_epochs": cfg["epochs"]},
        "space": {"train.lr": {"grid": lr_grid(cfg, graphs)}},
    }
    return raw


def seeds_job(cfg: dict, graphs: int, lane: int, lr: float) -> dict:
    raw = base_dict(cfg, graphs, lane)
    raw["train"]["lr"] = lr
    raw["compare"] = {
        "name": seeds_name(graphs),
        "storage_path": str(cfg["dir"] / "tune"),
        "seeds": cfg["seeds"],
        "max_concurrent_trials": 1,
        "variants": {f"g{graphs}": {"train.lr": lr}},
    }
    return raw


def write_job(raw: dict, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# generated by benchmarks/bench_batch.py from jobs/code2-batch-local.yaml\n"
                    + yaml.safe_dump(raw, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- running
def _env() -> dict:
    env = dict(os.environ, OUTDATED_IGNORE="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)  # each lane starts its own local Ray
    return env


def _satp() -> list[str]:
    return [sys.executable, "-m", "pipeline.cli"]


def run_logged(cmd: list[str], log: Path, timings: dict, key: str) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "ab") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=fh, stderr=subprocess.STDOUT).returncode
    timings[key] = time.perf_counter() - started
    print(f"== batch: {key} exited {rc} after {timings[key]:.0f} s", file=sys.stderr, flush=True)
    return rc


def prepare(cfg: dict, timings: dict) -> None:
    """The dataset (once) and the shards (once, before the lanes: they would build the same directory)."""
    d = cfg["dir"]
    if not (d / "data" / "ogbg_code2").exists():
        rc = run_logged([*_satp(), "data", "pycode", "--out", str(d / "data")], d / "logs" / "data.log", timings, "data")
        if rc:
            raise RuntimeError(f"satp data pycode failed (see {d / 'logs' / 'data.log'})")
    job = write_job(base_dict(cfg, cfg["sizes"][0], 0), d / "jobs" / "preprocess.yaml")
    rc = run_logged([*_satp(), "preprocess", str(job), "--no-progress"], d / "logs" / "preprocess.log", timings,
                    "preprocess")
    if rc:
        raise RuntimeError(f"satp preprocess failed (see {d / 'logs' / 'preprocess.log'})")


def run_lane(cfg: dict, lane: int, sizes: list[int], timings: dict, errors: list) -> None:
    d = cfg["dir"]
    for g in sizes:
        try:
            job = write_job(sweep_job(cfg, g, lane), d / "jobs" / f"sweep-g{g}.yaml")
            log = d / "logs" / f"sweep-g{g}.log"
            if run_logged([*_satp(), "tune", str(job)], log, timings, f"sweep g{g}"):
                errors.append(f"G={g}: satp tune failed (see {log})")
            sweep = read_sweep(cfg, g)
            best = best_trial(sweep)
            if best is None:
                errors.append(f"G={g}: no trial of the sweep finished")
                continue
            job = write_job(seeds_job(cfg, g, lane, best["lr"]), d / "jobs" / f"seeds-g{g}.yaml")
            log = d / "logs" / f"seeds-g{g}.log"
            if run_logged([*_satp(), "compare", str(job)], log, timings, f"seeds g{g}"):
                errors.append(f"G={g}: satp compare failed (see {log})")
        except Exception as exc:  # one size's failure leaves the others' results
            errors.append(f"G={g}: {type(exc).__name__}: {exc}")


# ----------------------------------------------------------------------------- reading results
def _latest_state(run_dir: Path) -> Optional[dict]:
    """The state.json with the longest history among a Train run's checkpoints."""
    best = None
    for path in run_dir.glob("checkpoint_*/state.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if best is None or len(state.get("history") or []) > len(best.get("history") or []):
            best = state
    return best


_TRIAL_ID = re.compile(r"_([0-9a-f]{5}_\d{5})_")


def _trial_params(sweep_dir: Path) -> dict[str, dict]:
    """trial id -> the trial's config (Tune's params.json in each trial directory)."""
    out = {}
    for params in sweep_dir.glob("*/params.json"):
        m = _TRIAL_ID.search(params.parent.name + "_")
        if not m:
            continue
        try:
            out[m.group(1)] = json.loads(params.read_text())
        except (OSError, ValueError):
            pass
    return out


def _read_runs(cfg: dict, name: str) -> list[dict]:
    sweep_dir = cfg["dir"] / "tune" / name
    params = _trial_params(sweep_dir)
    runs = []
    for run_dir in sorted((sweep_dir / "train").glob(f"{name}-*")):
        tid = run_dir.name[len(name) + 1:]
        state = _latest_state(run_dir)
        if state is None:
            continue
        runs.append({"trial_id": tid, "config": params.get(tid, {}), "history": state.get("history") or [],
                     "best": state.get("best") or {}, "constant": state.get("constant")})
    seen = {r["trial_id"] for r in runs}
    for tid, config in sorted(params.items()):  # trials without a finished epoch (e.g. errored at start)
        if tid not in seen:
            runs.append({"trial_id": tid, "config": config, "history": [], "best": {}, "constant": None})
    return runs


def read_sweep(cfg: dict, graphs: int) -> list[dict]:
    runs = _read_runs(cfg, sweep_name(graphs))
    for r in runs:
        r["lr"] = float(r["config"].get("train.lr", float("nan")))
        r["seed"] = int(r["config"].get("train.seed", 0))
        r["epochs_done"] = len(r["history"])
    return sorted(runs, key=lambda r: r["lr"])


def read_seeds(cfg: dict, graphs: int) -> list[dict]:
    runs = _read_runs(cfg, seeds_name(graphs))
    for r in runs:
        r["seed"] = int(r["config"].get("train.seed", -1))
        r["epochs_done"] = len(r["history"])
    return sorted(runs, key=lambda r: r["seed"])


def best_trial(sweep: list[dict]) -> Optional[dict]:
    """By the sweep's metric at the best epoch (what ``satp tune`` picks); ties: the longer run."""
    done = [r for r in sweep if r["history"] and r["best"].get("val") is not None]
    if not done:
        return None
    return max(done, key=lambda r: (r["best"]["val"], r["epochs_done"]))


# ----------------------------------------------------------------------------- curves
def _cum(history: list[dict], key: str, per_epoch: list[float]) -> list[float]:
    """Cumulative ``key`` (``steps``, ``elapsed_s``) from the history when present, else the running
    sum of ``per_epoch``."""
    if all(key in h for h in history):
        return [float(h[key]) for h in history]
    out, total = [], 0.0
    for v in per_epoch:
        total += v
        out.append(total)
    return out


def curve(run: dict, steps_per_epoch: int) -> dict[str, list[float]]:
    h = run["history"]
    return {
        "epoch": [int(e["epoch"]) for e in h],
        "val": [float(e.get("val_f1", float("nan"))) for e in h],
        "test": [float(e.get("test_f1", float("nan"))) for e in h],
        "steps": _cum(h, "steps", [steps_per_epoch] * len(h)),
        "time": _cum(h, "elapsed_s", [float(e.get("epoch_seconds", 0)) + float(e.get("eval_seconds", 0)) for e in h]),
        "epoch_s": [float(e.get("epoch_seconds", float("nan"))) for e in h],
        "eval_s": [float(e.get("eval_seconds", float("nan"))) for e in h],
        "graphs_per_step": [float(e["graphs_per_s"]) * float(e["epoch_seconds"]) / max(
            (float(e["steps"]) - (float(h[i - 1]["steps"]) if i else 0.0)), 1.0)
            for i, e in enumerate(h) if "graphs_per_s" in e and "epoch_seconds" in e and "steps" in e],
    }


def sampler_stats(cfg: dict, graphs: int) -> dict[str, float]:
    """Graphs per step as the product's sampler cuts the training split (epochs 0..E-1), measured on the
    shards: mean, min, max and the batches per epoch."""
    import numpy as np

    from pipeline.config import JobConfig
    from pipeline.train.loader import open_split
    from pipeline.train.worker import split_sampler

    job = JobConfig.model_validate(base_dict(cfg, graphs, 0))
    ds = open_split(shard_dirs(cfg)[-1], "train")
    sampler = split_sampler(job, ds, shuffle=True)
    counts = [len(b) for e in range(cfg["epochs"]) for b in sampler.epoch_batches(e)]
    return {"mean": float(np.mean(counts)), "min": float(min(counts)), "max": float(max(counts)),
            "per_epoch": float(len(sampler)), "train": float(len(ds))}


def _interp_first(xs: list[float], ys: list[float], target: float) -> tuple[Optional[float], bool]:
    """The first x at which y reaches ``target`` (linear between evaluations); ``(x, at_first)`` with
    at_first True when the first evaluation already reaches it (then only ``<= x`` is known)."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= target:
            if i == 0:
                return x, True
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (x - x0) * (target - y0) / max(y - y0, 1e-12), False
    return None, False


def _mean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def _std(values: list[float]) -> float:
    values = [v for v in values if v == v]
    if len(values) < 2:
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def mean_curve(curves: list[dict], key: str) -> list[float]:
    n = min(len(c[key]) for c in curves)
    return [_mean([c[key][i] for c in curves]) for i in range(n)]


def fit_critical(points: list[tuple[int, float]]) -> Optional[tuple[float, float]]:
    """Least squares of S = S_min + S_min * G_crit * (1 / G); returns (S_min, G_crit) or None (fewer than
    3 points: two always fit exactly, whatever the noise)."""
    if len(points) < 3:
        return None
    xs = [1.0 / g for g, _ in points]
    ys = [s for _, s in points]
    mx, my = _mean(xs), _mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if intercept <= 0 or slope <= 0:
        return None
    return intercept, slope / intercept


# ----------------------------------------------------------------------------- analysis
def analyse(cfg: dict) -> dict:
    rows = []
    for g in cfg["sizes"]:
        sweep = read_sweep(cfg, g)
        best = best_trial(sweep)
        seeds = [r for r in read_seeds(cfg, g) if r["history"]]
        seed_lrs = {float(r["config"].get("train.lr", float("nan"))) for r in seeds}
        if best is not None and len(seed_lrs) == 1 and best["lr"] not in seed_lrs:
            # the seeds ran at the lr that was best when the sweep first finished (a trial resumed later,
            # e.g. one that had errored, may have overtaken it): the 3-seed point stays at the seeds' lr
            same = [r for r in sweep if r["lr"] in seed_lrs]
            if same:
                best = dict(same[0], overtaken_by=best)
        row: dict[str, Any] = {"G": g, "sweep": sweep, "best": best, "grid": lr_grid(cfg, g)}
        try:
            row["sampler"] = sampler_stats(cfg, g)
        except Exception as exc:
            row["sampler"] = None
            row["sampler_error"] = f"{type(exc).__name__}: {exc}"
        spe = int(row["sampler"]["per_epoch"]) if row["sampler"] else max(1, cfg["train_graphs"] // g)
        runs = []
        if best is not None:
            runs.append(best)
            runs += seeds
        full = [r for r in runs if r["epochs_done"] >= cfg["epochs"]]
        row["runs"] = runs
        row["full"] = full
        row["curves"] = [curve(r, spe) for r in full]
        row["steps_per_epoch"] = spe
        rows.append(row)

    # the common target: the highest mean validation F1 that every size's mean curve reaches
    usable = [r for r in rows if r["curves"]]
    for r in usable:
        r["mean_val"] = mean_curve(r["curves"], "val")
        r["mean_test"] = mean_curve(r["curves"], "test")
        r["mean_steps"] = mean_curve(r["curves"], "steps")
        r["mean_time"] = mean_curve(r["curves"], "time")
    # (rounded down to 4 decimals, so that the curve that defines it still reaches it)
    target = math.floor(min(max(r["mean_val"]) for r in usable) * 1e4) / 1e4 if usable else None
    targets = []
    if usable:
        targets = sorted({math.floor(target * f * 1e4) / 1e4 for f in (0.6, 0.8, 0.9, 1.0)})
    for r in usable:
        r["to_target"] = {}
        for t in targets:
            s, first = _interp_first(r["mean_steps"], r["mean_val"], t)
            w, _ = _interp_first(r["mean_time"], r["mean_val"], t)
            r["to_target"][t] = (s, w, first)
    critical = {}
    for t in targets:
        # a point known only as a bound (reached at the first evaluation) does not enter the fit
        pts = [(r["G"], r["to_target"][t][0]) for r in usable
               if r["to_target"][t][0] is not None and not r["to_target"][t][2]]
        critical[t] = {"points": pts, "fit": fit_critical(pts)}
    return {"rows": rows, "target": target, "targets": targets, "critical": critical}


# ----------------------------------------------------------------------------- figures
def plot(result: dict, cfg: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg["figures"].mkdir(parents=True, exist_ok=True)
    rows = [r for r in result["rows"] if r.get("curves")]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    out = []
    for xkey, fname, xlabel, logx in (("time", "batch_f1_vs_time.png", "wall-clock since training start (s, training + evaluation)", False),
                                      ("steps", "batch_f1_vs_steps.png", "optimizer steps", True)):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, split in zip(axes, ("val", "test")):
            for i, r in enumerate(rows):
                c = colors[i % len(colors)]
                for cv in r["curves"]:
                    ax.plot(cv[xkey], cv[split], "-", color=c, alpha=0.25, linewidth=0.8)
                xs = mean_curve(r["curves"], xkey)
                ys = mean_curve(r["curves"], split)
                ax.plot(xs, ys, "o-", color=c, linewidth=2,
                        label=f"G={r['G']} (lr {r['best']['lr']:.3g}, {len(r['curves'])} seeds)")
            if split == "val" and result["target"] is not None:
                ax.axhline(result["target"], color="grey", linestyle=":", linewidth=1,
                           label=f"common target {result['target']:.4f}")
            constant = _mean([float(x["constant"]) for r in rows for x in r["full"] if x.get("constant") is not None])
            if constant == constant:
                ax.axhline(constant, color="black", linestyle="--", linewidth=0.8,
                           label=f"best constant predictor (test) {constant:.4f}")
            if logx:
                ax.set_xscale("log")
            ax.set_xlabel(xlabel)
            ax.set_title(f"{split} F1 (mean over seeds; thin: each seed)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("F1 (OGB code2 evaluator)")
        axes[0].legend(fontsize=7, loc="lower right")
        axes[1].legend(fontsize=7, loc="lower right")
        fig.suptitle(f"SAT (code2-local model) on pycode: {cfg['train_graphs']} training functions x "
                     f"{cfg['epochs']} epochs, 1 CPU worker per run", fontsize=9)
        fig.tight_layout()
        path = cfg["figures"] / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out


# ----------------------------------------------------------------------------- the section
def _f(v: Optional[float], fmt: str = "{:.4f}") -> str:
    return "-" if v is None or v != v else fmt.format(v)


def _pm(values: list[float], fmt: str = "{:.4f}") -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(_mean(values))} ± {fmt.format(_std(values))}"


def section(result: dict, cfg: dict, timings: dict, load0, load1, errors: list[str], wall: float) -> str:
    rows = result["rows"]
    lines = [
        "## Batch size: time and steps to accuracy, code2-local model on pycode (`BENCH=batch`)",
        "",
        f"    nice -n 5 env SATP_BATCH_SIZES={','.join(map(str, cfg['sizes']))} SATP_BATCH_TRAIN={cfg['train_graphs']} "
        f"SATP_BATCH_EPOCHS={cfg['epochs']} SATP_BATCH_EVAL={cfg['eval_subset']} SATP_BATCH_LR32={cfg['lr32']:g} "
        f"SATP_BATCH_LR_FACTORS={','.join(f'{f:g}' for f in cfg['lr_factors'])} "
        f"SATP_BATCH_SEEDS={','.join(map(str, cfg['seeds']))} SATP_BATCH_GRACE={cfg['grace']} "
        f"SATP_BATCH_LANES={cfg['lanes']} BENCH=batch .venv/bin/python -m benchmarks.run",
        "",
        f"The model of `jobs/code2-local.yaml` (k-subtree SAT-GCN, 2 layers of width 64, dense attention, fp32) "
        f"on the offline Python-source data (`satp data pycode`, the standard library), "
        f"{cfg['train_graphs']:,} training functions (`data.max_graphs_per_split`), {cfg['epochs']} epochs for every G "
        f"(the same graphs seen: a larger G takes fewer steps), cosine schedule with a warm-up of "
        f"{WARMUP_FRACTION:.0%} of training (`warmup_epochs: {WARMUP_FRACTION * cfg['epochs']:g}`), validation and "
        f"test on {cfg['eval_subset']:,} functions each (`train.eval_subset`) after every epoch. One Ray Train worker "
        f"(1 CPU) per run, global batch = `max_graphs_per_batch: G` with `bucket_size: G` (batches of random graphs) "
        f"and a node budget that G of the largest graphs fit. Per G: `satp tune` (ASHA on `val_f1`, grace "
        f"{cfg['grace']} epoch(s), reduction factor 2, one trial at a time) over lr = "
        f"{{{', '.join(f'{f:g}' for f in cfg['lr_factors'])}}} x {cfg['lr32']:g} x sqrt(G/32), then the best lr again "
        f"with seeds {cfg['seeds']} (`satp compare`); the sweep's trial is seed 0. "
        f"{cfg['lanes']} lanes side by side (2 trials at once on the 2 cores). Jobs: `jobs/code2-batch-local.yaml` "
        f"with G and the grid filled in (`{cfg['dir'].name}/jobs/`).",
        "",
        f"CPU: {cpu_model()}, nproc {os.cpu_count()}. Load average (1/5/15 min) at start "
        f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, at end {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}: "
        "the machine is shared with other engineers' tests, so wall-clock figures include time spent waiting "
        f"for the CPUs. Study wall time {wall / 60:.1f} min"
        + (" (" + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ")" if timings else "") + ".",
        "",
        "### The sweeps (ASHA, seed 0)",
        "",
        "| G | lr | epochs run | best val F1 | status |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["sweep"]:
            lines.append(f"| {r['G']} | {', '.join(f'{x:g}' for x in r['grid'])} | - | - | no trial found |")
        for t in r["sweep"]:
            chosen = r["best"] is not None and t["trial_id"] == r["best"]["trial_id"]
            if r["best"] is not None and r["best"].get("overtaken_by", {}).get("trial_id") == t["trial_id"]:
                chosen = False
                t = dict(t, note="best, but finished after the seeds had run at the lr marked chosen")
            status = ("finished" if t["epochs_done"] >= cfg["epochs"] else "stopped by ASHA" if t["epochs_done"]
                      else "no epoch recorded (errored, or not run)")
            lines.append(f"| {r['G']} | {t['lr']:g}{' (sqrt rule)' if abs(t['lr'] - sqrt_rule_lr(cfg['lr32'], r['G'])) < 1e-9 * max(t['lr'], 1) else ''} "
                         f"| {t['epochs_done']} | {_f(t['best'].get('val'))} | {status}{', **chosen**' if chosen else ''}"
                         f"{', ' + t['note'] if t.get('note') else ''} |")
    lines += [
        "",
        "### Per batch size: the chosen lr, 3 seeds",
        "",
        "| G | lr chosen (x sqrt rule) | graphs per step (mean, min-max) | steps per epoch | train s per epoch | eval s per epoch "
        "| val F1 per epoch (mean, ± half-range over seeds) | final test F1 (mean ± std) | test F1 at best val epoch "
        "| steps to target | wall s to target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    target = result["target"]
    for r in rows:
        best = r["best"]
        if best is None or not r["curves"]:
            lines.append(f"| {r['G']} | - | - | - | - | - | no finished run | - | - | - | - |")
            continue
        s = r["sampler"]
        gps = f"{s['mean']:.1f} ({s['min']:.0f}-{s['max']:.0f})" if s else "-"
        measured = [x for cv in r["curves"] for x in cv["graphs_per_step"]]
        if measured:
            gps += f"; trained {_mean(measured):.1f}"
        cv = r["curves"]
        per_epoch = []
        for i in range(min(len(c["val"]) for c in cv)):
            vals = [c["val"][i] for c in cv]
            per_epoch.append(f"{_mean(vals):.4f}±{(max(vals) - min(vals)) / 2:.4f}")
        epoch_s = [x for c in cv for x in c["epoch_s"]]
        eval_s = [x for c in cv for x in c["eval_s"]]
        final_test = [c["test"][-1] for c in cv]
        best_test = [x["best"].get("test") for x in r["full"] if x["best"].get("test") is not None]
        if target is not None and target in r.get("to_target", {}):
            st, wt, first = r["to_target"][target]
            steps = ("≤ " if first else "") + _f(st, "{:.0f}")
            wall_t = ("≤ " if first else "") + _f(wt, "{:.0f}")
        else:
            steps = wall_t = "-"
        factor = best["lr"] / sqrt_rule_lr(cfg["lr32"], r["G"])
        lines.append(
            f"| {r['G']} | {best['lr']:g} (x{factor:g}) | {gps} | {r['steps_per_epoch']} | {_pm(epoch_s, '{:.1f}')} "
            f"| {_pm(eval_s, '{:.1f}')} | {' / '.join(per_epoch)} | {_pm(final_test)} (n={len(final_test)}) "
            f"| {_pm(best_test)} | {steps} | {wall_t} |")
    lines.append("")
    if target is not None:
        lines.append(f"Common target: val F1 {target:.4f}, the highest mean validation F1 that every batch size's "
                     "mean curve reaches (the lowest of their best). Steps and seconds to it: first crossing of the "
                     "seed-mean curve, linear between evaluations (one per epoch); `≤` when the first evaluation "
                     "already reaches it. Wall-clock: `elapsed_s` of the history (training and evaluation since the "
                     "first step, start-up excluded), mean over seeds.")
        lines += ["", "Steps to lower targets as well (fractions of the common target), and the fit "
                  "S(G) = S_min (1 + G_crit / G):", "",
                  "| val F1 target | " + " | ".join(f"steps G={r['G']}" for r in rows if r.get("curves"))
                  + " | S_min | G_crit (fit, bounds `≤` left out) |",
                  "|---|" + "---|" * (len([r for r in rows if r.get('curves')]) + 2)]
        for t in result["targets"]:
            cells = []
            for r in rows:
                if not r.get("curves"):
                    continue
                st, _, first = r["to_target"][t]
                cells.append(("≤ " if first else "") + _f(st, "{:.0f}"))
            fit = result["critical"][t]["fit"]
            lines.append(f"| {t:.4f} | " + " | ".join(cells) + f" | {_f(fit[0] if fit else None, '{:.0f}')} "
                         f"| {_f(fit[1] if fit else None, '{:.0f}')} |")
        lines.append("")
        lines.append(critical_statement(result))
    lines += ["", "![F1 vs wall-clock](../docs/figures/batch_f1_vs_time.png)",
              "![F1 vs steps](../docs/figures/batch_f1_vs_steps.png)"]
    if errors:
        lines += ["", "Errors: " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


def critical_statement(result: dict) -> str:
    target = result["target"]
    rows = [r for r in result["rows"] if r.get("curves")]
    pts = [(r["G"], r["to_target"][target][0], r["to_target"][target][2]) for r in rows]
    parts = []
    for (g0, s0, f0), (g1, s1, f1) in zip(pts, pts[1:]):
        if s0 is None or s1 is None:
            continue
        ratio = s0 / max(s1, 1e-9)
        parts.append(f"G {g0} -> {g1} ({g1 / g0:g}x the batch): steps to target / {ratio:.2f} "
                     f"({ratio / (g1 / g0):.0%} of perfect scaling){' (bounded: first evaluation)' if f0 or f1 else ''}")
    fit = result["critical"][target]["fit"]
    graphs = [(g, st * g) for g, st, first in pts if st is not None and not first]
    text = "Critical batch size. " + "; ".join(parts) + ". "
    if graphs:
        e_min = min(e for _, e in graphs)
        text += ("Graphs seen to the target (steps x G): " + ", ".join(f"G={g}: {e:,.0f}" for g, e in graphs)
                 + "; with E(G) = E_min (1 + G / G_crit) and E_min the smallest of them, each larger G gives G_crit = "
                 + ", ".join(f"{g / (e / e_min - 1):,.0f} (G={g})" for g, e in graphs if e / e_min > 1.05)
                 + ". ")
    if fit:
        text += (f"The fit S(G) = S_min (1 + G_crit / G) at the common target gives S_min = {fit[0]:.0f} steps and "
                 f"G_crit ≈ {fit[1]:.0f} graphs: below it doubling the batch nearly halves the steps, above it it "
                 "saves less and less (at G_crit, twice the minimal steps and twice the minimal graphs).")
    else:
        text += "The fit S(G) = S_min (1 + G_crit / G) is undetermined at the common target (too few points or a non-positive slope)."
    return text


# ----------------------------------------------------------------------------- entry point
def run() -> str:
    cfg = settings()
    cfg["dir"].mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    started = time.perf_counter()
    timings: dict[str, float] = {}
    errors: list[str] = []
    if not cfg["report_only"]:
        prepare(cfg, timings)
        threads = [threading.Thread(target=run_lane, args=(cfg, i, sizes, timings, errors), daemon=True)
                   for i, sizes in enumerate(lanes_of(cfg["sizes"], cfg["lanes"]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - started
    load1 = os.getloadavg()
    record = cfg["dir"] / "run.json"  # the measured run's timings and load, for a later report-only pass
    if not cfg["report_only"]:
        record.write_text(json.dumps({"timings": timings, "load0": load0, "load1": load1, "wall": wall,
                                      "errors": errors}, indent=1))
    elif record.exists():
        saved = json.loads(record.read_text())
        timings, load0, load1, wall = saved["timings"], saved["load0"], saved["load1"], saved["wall"]
        errors = saved.get("errors", []) + errors
    result = analyse(cfg)
    try:
        plot(result, cfg)
    except Exception as exc:
        errors.append(f"plots: {type(exc).__name__}: {exc}")
    text = section(result, cfg, timings, load0, load1, errors, wall)
    (cfg["dir"] / "section.md").write_text(text)
    summary = {str(r["G"]): {"lr": r["best"]["lr"] if r["best"] else None,
                             "curves": r.get("curves")} for r in result["rows"]}
    (cfg["dir"] / "curves.json").write_text(json.dumps(summary, indent=1))
    return text


def main() -> int:
    print(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
