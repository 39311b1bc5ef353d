"""The batch-size study's settings and job files (:mod:`benchmarks.accuracy.batch`): its paths and
constants, the ``SATP_BATCH_*`` settings, the lr grid of the square-root rule, the lanes, and the job
files made from ``jobs/code2-batch-local.yaml`` for each global batch G (the sweep for ``satp tune``,
the seeds for ``satp compare``)."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
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
    path.write_text(f"# generated by benchmarks/accuracy/batch.py from jobs/code2-batch-local.yaml\n"
                    + yaml.safe_dump(raw, sort_keys=False))
    return path
