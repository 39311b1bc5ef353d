"""The batch-size study's figures and section (:mod:`benchmarks.accuracy.batch`): F1 against wall-clock
and against optimizer steps (``docs/figures/batch_f1_vs_*.png``), the markdown section with the
sweeps, the per-size table, the steps to the targets, and the statement on the critical batch size."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from benchmarks.accuracy.batch_analysis import _mean, _std, mean_curve
from benchmarks.accuracy.batch_jobs import WARMUP_FRACTION, sqrt_rule_lr
from benchmarks.machine import cpu_model


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
