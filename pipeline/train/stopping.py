"""When a run stops before ``train.epochs``: a quality target reached, or a validation plateau.

``train.target`` is scored as MLPerf Training does: the wall-clock (``elapsed_s``) to the first
evaluation that reaches it (:func:`time_to_target`). ``train.patience`` stops a run after that many
evaluations without a new best validation metric. Both are pure functions of the history, so a
rerun applies them to a checkpoint's history as the workers did.
"""
from __future__ import annotations

from typing import Any, Optional

def check_target(target, task_metric: str) -> None:
    """Raise a one-line ``ValueError`` when ``train.target.metric`` is not one the task reports."""
    reported = [f"{split}_{task_metric}" for split in ("train", "val", "test")]
    if target is not None and target.metric not in reported:
        raise ValueError(f"train.target.metric {target.metric!r}: this task reports {', '.join(reported)}")


def reached(value: Optional[float], target: float, mode: str) -> bool:
    """Whether ``value`` meets ``target`` (``>=`` for a metric to maximise, ``<=`` to minimise)."""
    if value is None:
        return False
    return value >= target if mode == "max" else value <= target


def time_to_target(history: list[dict[str, Any]], target, mode: str) -> Optional[dict[str, Any]]:
    """The first epoch of ``history`` whose ``target.metric`` meets ``target.value``, as
    ``{"time_to_target_s", "steps_to_target", "epochs_to_target", "epoch"}``; None if none did."""
    if target is None:
        return None
    for entry in history:
        if reached(entry.get(target.metric), target.value, mode):
            return {"time_to_target_s": entry.get("elapsed_s"), "steps_to_target": entry.get("steps"),
                    "epochs_to_target": int(entry["epoch"]) + 1, "epoch": int(entry["epoch"])}
    return None


def plateau(history: list[dict[str, Any]], val_key: str, patience: Optional[int], mode: str) -> bool:
    """Whether the last ``patience`` evaluations of ``history`` brought no new best ``val_key``."""
    if not patience:
        return False
    values = [entry[val_key] for entry in history if entry.get(val_key) is not None]
    if len(values) <= patience:
        return False
    pick = max if mode == "max" else min
    best_index = values.index(pick(values))  # the first best: a tie is no improvement
    return len(values) - 1 - best_index >= patience


def stop_reason(history: list[dict[str, Any]], train, task_metric: str, mode: str) -> Optional[str]:
    """Why a run with this ``history`` stops after its last epoch (None: it goes on). One line."""
    if not history:
        return None
    target, last = train.target, history[-1]
    if target is not None and reached(last.get(target.metric), target.value, mode):
        sign = ">=" if mode == "max" else "<="
        return (f"target {target.metric} {sign} {target.value:g} reached at epoch {last['epoch']} "
                f"({last[target.metric]:.4f})")
    val_key = f"val_{task_metric}"
    if plateau(history, val_key, train.patience, mode):
        return f"no better {val_key} in {train.patience} evaluations (plateau)"
    return None


def stopped_within(history: list[dict[str, Any]], train, task_metric: str, mode: str) -> Optional[str]:
    """The reason the rules of ``train`` stop a run somewhere within ``history`` (a rerun's check:
    a run that stopped under these rules has nothing left to train), else None."""
    for end in range(1, len(history) + 1):
        reason = stop_reason(history[:end], train, task_metric, mode)
        if reason is not None:
            return reason
    return None
