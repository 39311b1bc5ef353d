"""How the GPU accuracy parts (:mod:`~benchmarks.gpu.accuracy_runs`) write up what they measured: number
formats, the per-epoch curve table, the device line and the metric-vs-time plot."""
from __future__ import annotations

from pathlib import Path
from typing import Optional



def _fmt(value, spec: str = ".4f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.3f}"


def curve_table(history: list[dict], metric: str, observed: dict, target_epoch: Optional[int] = None) -> list[str]:
    """One row per evaluated epoch: what the next session needs to see why a target was (not) reached.
    With ``train.precise_bn_batches``, three columns more: the validation metric under BatchNorm's
    moving averages, before the statistics were recomputed, and how far those averages were from the
    recomputed statistics: the variance ratio (dropout's variance shift) and the mean shift in
    standard deviations (:mod:`pipeline.train.precise_bn`)."""
    running_bn = f"val_{metric}_running_bn"
    both = any(h.get(running_bn) is not None for h in history)
    bn_header = f" val {metric}, running BN | BN var ratio | BN mean shift |" if both else ""
    lines = [f"| epoch | elapsed s (train + eval) | wall s since `satp train` start | steps | lr | train loss "
             f"| train {metric} | val {metric} |{bn_header} test {metric} "
             f"| epoch s | eval s | graphs/s | data wait |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if both else "")]
    for h in history:
        e = int(h["epoch"])
        mark = " **(target)**" if e == target_epoch else ""
        wall = observed.get(e, observed.get(str(e)))
        bn_cells = (f" {_fmt(h.get(running_bn))} | {_fmt(h.get('bn_var_ratio'), '.3f')} "
                    f"| {_fmt(h.get('bn_mean_shift'), '.3f')} |") if both else ""
        lines.append(
            f"| {e}{mark} | {_fmt(h.get('elapsed_s'), '.1f')} | {_fmt(wall, '.0f')} | {h.get('steps', '-')} "
            f"| {_fmt(h.get('lr'), '.2e')} | {_fmt(h.get('train_loss'), '.4f')} | {_fmt(h.get(f'train_{metric}'))} "
            f"| {_fmt(h.get(f'val_{metric}'))} |{bn_cells}"
            f" {_fmt(h.get(f'test_{metric}'))} | {_fmt(h.get('epoch_seconds'), '.1f')} "
            f"| {_fmt(h.get('eval_seconds'), '.1f')} | {_fmt(h.get('graphs_per_s'), ',.0f')} "
            f"| {_fmt(None if h.get('data_wait_frac') is None else 100 * h['data_wait_frac'], '.1f')}% |")
    return lines


def _save_plot(history: list[dict], metric: str, target: Optional[dict], path: Path) -> None:
    try:
        from pipeline.registry.tracking import plot_metric_vs_time

        if any(h.get("elapsed_s") is not None for h in history):
            plot_metric_vs_time(history, metric, path, target)
    except Exception as exc:  # matplotlib may be missing on the image: the table has the same figures
        print(f"   (no plot: {exc})", flush=True)
