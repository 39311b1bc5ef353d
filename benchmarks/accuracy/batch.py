"""Batch-size study, time to accuracy against the global batch on the CPU: ``BENCH=batch .venv/bin/python
-m benchmarks.run`` (or ``python -m benchmarks.accuracy.batch``, which prints the section only).

For global batches of G graphs (``SATP_BATCH_SIZES``, default 32,128,512,2048), the model of
``jobs/code2-local.yaml`` on the offline Python-source data through the product's commands, with job files
made from ``jobs/code2-batch-local.yaml`` (``max_graphs_per_batch`` = ``bucket_size`` = G: every step takes
G random graphs; the same ``SATP_BATCH_TRAIN`` training functions and ``SATP_BATCH_EPOCHS`` epochs for
every G, a cosine schedule with 10% warm-up):

1. ``satp tune``: an ASHA sweep of ``train.lr`` over ``SATP_BATCH_LR_FACTORS`` x lr_32 x sqrt(G / 32)
   (the square-root rule's value first), seed 0;
2. ``satp compare``: the sweep's best lr again with the seeds ``SATP_BATCH_SEEDS``;
3. from the trials' checkpoints (their ``state.json`` history): F1 against wall-clock and against steps
   (``docs/figures/batch_f1_vs_{time,steps}.png``), the steps and seconds to the highest validation F1
   every G's seed-mean curve reaches (linear between evaluations), and the critical batch size: the fit
   S(G) = S_min (1 + G_crit / G) of those steps (McCandlish et al., 2018).

The sizes run in ``SATP_BATCH_LANES`` lanes side by side (one CPU each), everything under
``SATP_BATCH_DIR`` (default ``runs/batch-study``); a rerun finds the finished sweeps (the product's reruns)
and only reports, ``SATP_BATCH_REPORT_ONLY=1`` reports without running anything.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from benchmarks.machine import cpu_model

ROOT = Path(__file__).resolve().parents[2]
BASE_JOB = ROOT / "jobs" / "code2-batch-local.yaml"
WARMUP_FRACTION = 0.1


def _numbers(text: str, kind=int) -> list:
    return [kind(s) for s in text.split(",") if s.strip()]


def settings() -> dict:
    env = os.environ.get
    return {"sizes": _numbers(env("SATP_BATCH_SIZES", "32,128,512,2048")), "train_graphs": int(env("SATP_BATCH_TRAIN", "4096")),
            "epochs": int(env("SATP_BATCH_EPOCHS", "4")), "eval_subset": int(env("SATP_BATCH_EVAL", "1000")),
            "lr32": float(env("SATP_BATCH_LR32", "2e-3")), "lr_factors": _numbers(env("SATP_BATCH_LR_FACTORS", "1,0.5,2"), float),
            "seeds": _numbers(env("SATP_BATCH_SEEDS", "1,2")), "grace": int(env("SATP_BATCH_GRACE", "1")),
            "lanes": max(1, int(env("SATP_BATCH_LANES", "2"))),
            "dir": Path(env("SATP_BATCH_DIR", str(ROOT / "runs" / "batch-study"))).resolve(),
            "report_only": env("SATP_BATCH_REPORT_ONLY", "0") not in ("", "0", "false"),
            "figures": Path(env("SATP_BATCH_FIGURES", str(ROOT / "docs" / "figures"))).resolve()}


def sqrt_rule_lr(cfg: dict, graphs: int) -> float:
    return cfg["lr32"] * math.sqrt(graphs / 32)


# ----------------------------------------------------------------------------- job files, runs
def job_dict(cfg: dict, graphs: int, section: Optional[str] = None, lr: Optional[float] = None) -> dict:
    """The job of one G: paths under the study's folder, G random graphs per step, a node budget that G of
    the largest graphs fit; with ``section`` its sweep (``tune``) or its seeds at ``lr`` (``compare``)."""
    import yaml

    d = cfg["dir"]
    raw = yaml.safe_load(BASE_JOB.read_text())
    raw.pop("tune", None)
    raw["name"] = f"code2-batch-g{graphs}"
    raw["data"].update(root=str(d / "data"), max_graphs_per_split=cfg["train_graphs"])
    raw["shards"]["root"] = str(d / "shards")
    t = raw["train"]
    t.update(epochs=cfg["epochs"], warmup_epochs=round(WARMUP_FRACTION * cfg["epochs"], 4), max_graphs_per_batch=graphs,
             bucket_size=graphs, eval_subset=cfg["eval_subset"], lr=lr or sqrt_rule_lr(cfg, graphs),
             storage_path=str(d / "ray"), node_budget=max(int(t["node_budget"]), graphs * (largest_graph(cfg) + 48)))
    raw["mlflow"]["tracking_uri"] = f"sqlite:///{d / f'mlflow-g{graphs}.db'}"  # one store per G: lanes never share one
    if section == "tune":
        raw["tune"] = {"name": f"code2-batch-g{graphs}", "storage_path": str(d / "tune"), "num_samples": 1,
                       "metric": "val_f1", "mode": "max", "max_concurrent_trials": 1, "seed": 0, "register_best": False,
                       "asha": {"grace_period": cfg["grace"], "reduction_factor": 2, "max_epochs": cfg["epochs"]},
                       "space": {"train.lr": {"grid": [float(f"{sqrt_rule_lr(cfg, graphs) * f:.4g}") for f in cfg["lr_factors"]]}}}
    elif section == "compare":
        raw["compare"] = {"name": f"code2-batch-g{graphs}-seeds", "storage_path": str(d / "tune"), "seeds": cfg["seeds"],
                          "max_concurrent_trials": 1, "variants": {f"g{graphs}": {"train.lr": lr}}}
    return raw


def largest_graph(cfg: dict) -> int:
    """The largest training graph of the study's newest shards (before there are any: a bound for the stdlib corpus)."""
    import numpy as np

    from pipeline.train.loader import open_split

    shards = sorted((cfg["dir"] / "shards").glob("ogbg-code2-*/manifest.json"), key=lambda p: p.stat().st_mtime)
    return int(np.max(open_split(shards[-1].parent, "train").num_nodes)) if shards else 2560


def satp(cfg: dict, command: str, raw: Optional[dict], log: str, timings: dict, args: tuple = ()) -> int:
    """``satp command JOB args`` (``raw`` written as the job file) in a subprocess, output to ``logs/LOG.log``."""
    import yaml

    cmd = [sys.executable, "-m", "pipeline.cli", command]
    if raw is not None:
        path = cfg["dir"] / "jobs" / f"{log}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# generated by benchmarks/accuracy/batch.py from jobs/code2-batch-local.yaml\n"
                        + yaml.safe_dump(raw, sort_keys=False))
        cmd.append(str(path))
    env = dict(os.environ, OUTDATED_IGNORE="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)  # each lane starts its own local Ray
    (cfg["dir"] / "logs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(cfg["dir"] / "logs" / f"{log}.log", "ab") as out:
        rc = subprocess.run([*cmd, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    timings[log] = time.perf_counter() - started
    print(f"== batch: {log} exited {rc} after {timings[log]:.0f} s", file=sys.stderr, flush=True)
    return rc


def trials(cfg: dict, name: str) -> list[dict]:
    """The trials of the sweep or comparison ``name``: Tune's config, and the history and best epoch of
    the newest intact checkpoint of each one's Train run."""
    from ray.tune import ExperimentAnalysis

    from pipeline.train.checkpoint import CheckpointManager, load_state

    sweep_dir = cfg["dir"] / "tune" / name
    if not sweep_dir.is_dir():
        return []
    out = []
    for trial in ExperimentAnalysis(str(sweep_dir)).trials:
        run_dir = sweep_dir / "train" / f"{name}-{trial.trial_id}"
        newest = CheckpointManager(run_dir).newest_intact(warn=False) if run_dir.is_dir() else None
        state = load_state(run_dir / newest) if newest else {}
        out.append({"lr": float(trial.config.get("train.lr", "nan")), "seed": int(trial.config.get("train.seed", 0)),
                    "history": state.get("history") or [], "best": state.get("best") or {}})
    return sorted(out, key=lambda t: (t["lr"], t["seed"]))


def best_trial(sweep: list[dict]) -> Optional[dict]:
    """The sweep's pick: the best validation F1 (ties: the longer run)."""
    done = [t for t in sweep if t["best"].get("val") is not None]
    return max(done, key=lambda t: (t["best"]["val"], len(t["history"])), default=None)


def run_lane(cfg: dict, sizes: list[int], timings: dict, errors: list) -> None:
    for g in sizes:
        try:
            if satp(cfg, "tune", job_dict(cfg, g, "tune"), f"sweep-g{g}", timings):
                errors.append(f"G={g}: satp tune failed (logs/sweep-g{g}.log)")
            best = best_trial(trials(cfg, f"code2-batch-g{g}"))
            if best is None:
                errors.append(f"G={g}: no trial of the sweep finished")
            elif satp(cfg, "compare", job_dict(cfg, g, "compare", best["lr"]), f"seeds-g{g}", timings):
                errors.append(f"G={g}: satp compare failed (logs/seeds-g{g}.log)")
        except Exception as exc:  # one size's failure leaves the others' results
            errors.append(f"G={g}: {type(exc).__name__}: {exc}")


def lanes_of(sizes: list[int], lanes: int) -> list[list[int]]:
    """Sizes dealt to lanes so that each lane gets a large and a small one (largest first)."""
    order, n = sorted(sizes, reverse=True), min(lanes, len(sizes))
    out: list[list[int]] = [[] for _ in range(n)]
    for i, g in enumerate(order):
        k = i % (2 * n)
        out[k if k < n else 2 * n - 1 - k].append(g)
    return out


# ----------------------------------------------------------------------------- analysis
def first_crossing(xs: list[float], ys: list[float], target: float) -> tuple[Optional[float], bool]:
    """The first x at which y reaches ``target``, linear between evaluations; ``(x, True)`` when the first
    evaluation already reaches it (only ``<= x`` is known)."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= target:
            if i == 0:
                return x, True
            return xs[i - 1] + (x - xs[i - 1]) * (target - ys[i - 1]) / max(y - ys[i - 1], 1e-12), False
    return None, False


def mean_curve(runs: list[dict], key: str) -> list[float]:
    n = min(len(r["history"]) for r in runs)
    return [statistics.fmean(float(r["history"][i].get(key, math.nan)) for r in runs) for i in range(n)]


def fit_critical(points: list[tuple[int, float]]) -> Optional[tuple[float, float]]:
    """Least squares of S = S_min + S_min G_crit / G: ``(S_min, G_crit)``, or None (fewer than 3 points
    always fit, whatever the noise; a non-positive slope or intercept)."""
    if len(points) < 3:
        return None
    xs, ys = [1.0 / g for g, _ in points], [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return (intercept, slope / intercept) if intercept > 0 and slope > 0 else None


def analyse(cfg: dict) -> dict:
    rows = []
    for g in cfg["sizes"]:
        sweep = trials(cfg, f"code2-batch-g{g}")
        seeds = [t for t in trials(cfg, f"code2-batch-g{g}-seeds") if t["history"]]
        best = best_trial(sweep)
        if best is not None and seeds and best["lr"] != seeds[0]["lr"]:  # a trial resumed after the seeds ran won
            best = next((t for t in sweep if t["lr"] == seeds[0]["lr"]), best)
        full = [t for t in ([best] if best else []) + seeds if len(t["history"]) >= cfg["epochs"]]
        rows.append({"G": g, "sweep": sweep, "best": best, "full": full})
    usable = [r for r in rows if r["full"]]
    for r in usable:
        r["curve"] = {k: mean_curve(r["full"], k) for k in ("val_f1", "test_f1", "steps", "elapsed_s")}
    # the common target: the highest mean validation F1 every size reaches (rounded down: its own curve reaches it)
    target = math.floor(min(max(r["curve"]["val_f1"]) for r in usable) * 1e4) / 1e4 if usable else None
    for r in usable:
        steps, first = first_crossing(r["curve"]["steps"], r["curve"]["val_f1"], target)
        r["to_target"] = (steps, first_crossing(r["curve"]["elapsed_s"], r["curve"]["val_f1"], target)[0], first)
    # a point known only as a bound (reached at the first evaluation) does not enter the fit
    fit = fit_critical([(r["G"], r["to_target"][0]) for r in usable if r["to_target"][0] is not None and not r["to_target"][2]])
    return {"rows": rows, "target": target, "fit": fit}


# ----------------------------------------------------------------------------- figures and section
def plot(result: dict, cfg: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg["figures"].mkdir(parents=True, exist_ok=True)
    rows = [r for r in result["rows"] if r["full"]]
    for xkey, name, label in (("elapsed_s", "batch_f1_vs_time.png", "seconds of training + evaluation"),
                              ("steps", "batch_f1_vs_steps.png", "optimizer steps")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, split in zip(axes, ("val_f1", "test_f1")):
            for i, r in enumerate(rows):
                color = f"C{i}"
                for t in r["full"]:
                    ax.plot([h[xkey] for h in t["history"]], [h[split] for h in t["history"]], color=color, alpha=0.25, lw=0.8)
                ax.plot(r["curve"][xkey], r["curve"][split], "o-", color=color, lw=2,
                        label=f"G={r['G']} (lr {r['best']['lr']:.3g}, {len(r['full'])} seeds)")
            if split == "val_f1" and result["target"] is not None:
                ax.axhline(result["target"], color="grey", ls=":", lw=1, label=f"common target {result['target']:.4f}")
            ax.set(xlabel=label, title=f"{split} (mean over seeds; thin: each seed)", xscale="log" if xkey == "steps" else "linear")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
        fig.suptitle(f"SAT (code2-local model) on pycode: {cfg['train_graphs']} training functions x {cfg['epochs']} "
                     "epochs, 1 CPU worker per run", fontsize=9)
        fig.tight_layout()
        fig.savefig(cfg["figures"] / name, dpi=110)
        plt.close(fig)


def _pm(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.fmean(values):.4f}" + (f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else "")


def section(result: dict, cfg: dict, timings: dict, loads: tuple, errors: list[str], wall: float) -> str:
    env = (f"SATP_BATCH_SIZES={','.join(map(str, cfg['sizes']))} SATP_BATCH_TRAIN={cfg['train_graphs']} "
           f"SATP_BATCH_EPOCHS={cfg['epochs']} SATP_BATCH_EVAL={cfg['eval_subset']} SATP_BATCH_LR32={cfg['lr32']:g} "
           f"SATP_BATCH_LR_FACTORS={','.join(f'{f:g}' for f in cfg['lr_factors'])} "
           f"SATP_BATCH_SEEDS={','.join(map(str, cfg['seeds']))} SATP_BATCH_GRACE={cfg['grace']} SATP_BATCH_LANES={cfg['lanes']}")
    lines = ["## Batch size: time and steps to accuracy (CPU)", "", f"    env {env} BENCH=batch .venv/bin/python -m benchmarks.run", "",
             f"CPU: {cpu_model()}, nproc {os.cpu_count()}; load average at start {loads[0]:.2f}, at end {loads[1]:.2f}; "
             f"study wall time {wall / 60:.1f} min" + (" (" + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ")"
                                                        if timings else "") + ".", "",
             "### The sweeps (ASHA, seed 0)", "", "| G | lr | epochs run | best val F1 |", "|---|---|---|---|"]
    for r in result["rows"]:
        lines += [f"| {r['G']} | {t['lr']:g}{' (chosen)' if t is r['best'] else ''} | {len(t['history'])} "
                  f"| {t['best'].get('val', float('nan')):.4f} |" for t in r["sweep"]]
    lines += ["", "### Per batch size: the chosen lr, 3 seeds", "",
              "| G | lr chosen (x sqrt rule) | steps per epoch | train s per epoch | eval s per epoch | final test F1 (mean ± std) "
              "| test F1 at best val epoch | steps to target | wall s to target |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if not r["full"]:
            lines.append(f"| {r['G']} | - | no finished run | | | | | | |")
            continue
        steps, wall_s, first = r["to_target"]
        bound = "≤ " if first else ""
        history = [h for t in r["full"] for h in t["history"]]
        lines.append(
            f"| {r['G']} | {r['best']['lr']:g} (x{r['best']['lr'] / sqrt_rule_lr(cfg, r['G']):.2g}) | {r['full'][0]['history'][0]['steps']} "
            f"| {statistics.fmean(h['epoch_seconds'] for h in history):.1f} | {statistics.fmean(h['eval_seconds'] for h in history):.1f} "
            f"| {_pm([t['history'][-1]['test_f1'] for t in r['full']])} (n={len(r['full'])}) "
            f"| {_pm([t['best']['test'] for t in r['full'] if t['best'].get('test') is not None])} "
            f"| {'-' if steps is None else f'{bound}{steps:.0f}'} | {'-' if wall_s is None else f'{bound}{wall_s:.0f}'} |")
    if result["target"] is not None:
        lines += ["", f"Common target: val F1 {result['target']:.4f}, the highest mean validation F1 that every batch size's "
                      "mean curve reaches. Steps and seconds to it: the first crossing of the seed-mean curve, linear between "
                      "evaluations (`≤`: reached at the first one); seconds of training and evaluation (`elapsed_s`)."]
        pairs = [(a, b) for a, b in zip(result["rows"], result["rows"][1:]) if a.get("to_target") and b.get("to_target")
                 and a["to_target"][0] and b["to_target"][0]]
        ratios = [f"{a['G']} -> {b['G']}: steps / {a['to_target'][0] / b['to_target'][0]:.2f} "
                  f"({a['to_target'][0] / b['to_target'][0] / (b['G'] / a['G']):.0%} of perfect scaling)" for a, b in pairs]
        fit = result["fit"]
        lines += ["", "Steps to the target, G " + "; ".join(ratios) + ". Fit S(G) = S_min (1 + G_crit / G): "
                  + (f"S_min {fit[0]:.0f} steps, G_crit {fit[1]:.0f} graphs." if fit else "undetermined (too few points).")]
    lines += ["", "![F1 vs wall-clock](../docs/figures/batch_f1_vs_time.png)", "![F1 vs steps](../docs/figures/batch_f1_vs_steps.png)"]
    return "\n".join(lines + (["", "Errors: " + "; ".join(errors)] if errors else [])) + "\n"


# ----------------------------------------------------------------------------- entry point
def run() -> str:
    cfg = settings()
    cfg["dir"].mkdir(parents=True, exist_ok=True)
    record = cfg["dir"] / "run.json"  # the measured run's timings and load, for a later report-only pass
    if cfg["report_only"] and record.exists():
        saved = json.loads(record.read_text())
        timings, loads, errors, wall = saved["timings"], tuple(saved["loads"]), saved["errors"], saved["wall"]
    else:
        timings, errors, load0, started = {}, [], os.getloadavg()[0], time.perf_counter()
        if not cfg["report_only"]:
            if not (cfg["dir"] / "data" / "ogbg_code2").exists() and satp(
                    cfg, "data", None, "data", timings, ("pycode", "--out", str(cfg["dir"] / "data"))):
                raise RuntimeError(f"satp data pycode failed (see {cfg['dir'] / 'logs' / 'data.log'})")
            # the shards before the lanes: they would build the same folder
            if satp(cfg, "preprocess", job_dict(cfg, cfg["sizes"][0]), "preprocess", timings, ("--no-progress",)):
                raise RuntimeError(f"satp preprocess failed (see {cfg['dir'] / 'logs' / 'preprocess.log'})")
            lanes = [threading.Thread(target=run_lane, args=(cfg, sizes, timings, errors))
                     for sizes in lanes_of(cfg["sizes"], cfg["lanes"])]
            for lane in lanes:
                lane.start()
            for lane in lanes:
                lane.join()
        wall, loads = time.perf_counter() - started, (load0, os.getloadavg()[0])
        if not cfg["report_only"]:
            record.write_text(json.dumps({"timings": timings, "loads": loads, "errors": errors, "wall": wall}, indent=1))
    result = analyse(cfg)
    try:
        plot(result, cfg)
    except Exception as exc:  # matplotlib may be missing: the section has the figures' numbers
        errors.append(f"plots: {type(exc).__name__}: {exc}")
    text = section(result, cfg, timings, loads, errors, wall)
    (cfg["dir"] / "section.md").write_text(text)
    return text


if __name__ == "__main__":
    print(run())
