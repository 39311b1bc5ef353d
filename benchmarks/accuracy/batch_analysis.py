"""Reading and analysing the batch-size study's runs (:mod:`benchmarks.accuracy.batch`): each trial's
history from its Train checkpoints, the sweeps' best lr, the F1 curves per batch size, the graphs per
step of the product's sampler, the steps and seconds to a common validation F1 target, and the fit of
the critical batch size."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional

from benchmarks.accuracy.batch_jobs import base_dict, lr_grid, seeds_name, shard_dirs, sweep_name


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
    from pipeline.train.batching import split_sampler

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
