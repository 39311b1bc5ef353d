"""The benchmarks' own parts on CPU: the shards of job-shaped graphs (benchmarks/graphs/jobs.py) the
GPU train-step benchmark (benchmarks/gpu/step.py) measures the product's trainer on, and that
benchmark's figures; the scale benchmark's row; the batch-size study's analysis; the GPU accuracy
parts' helpers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu.step import job_for
from benchmarks.graphs.jobs import job_shards
from pipeline.train.loader import BatchCollator, open_split
from pipeline.train.plan import worker_setup
from sat import SAT
from sat.config import SATConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec, task, classes", [({"job": "jobs/code2.yaml"}, "code2", 5002),
                                                 ({"job": "jobs/code2.yaml", "extractor": "subgraph"}, "code2", 5002),
                                                 ({"job": "jobs/ppa.yaml"}, "ppa", 37),
                                                 ({"job": "jobs/pattern.yaml"}, "pattern", 2)])
def test_job_shards_give_the_worker_setup_of_each_job_and_train(spec, task, classes, tmp_path):
    job = job_for(dict(spec, tiny=True, node_budget=4096))
    shards = job_shards(job, tmp_path / "shards", 6, eval_graphs=4)
    assert job_shards(job, shards, 6) == shards  # made once, then reused
    assert [len(open_split(shards, s)) for s in ("train", "valid", "test")] == [6, 4, 4]
    setup = worker_setup(job, shards)
    config = SATConfig.from_dict(setup.model_config)
    assert setup.task_name == task and setup.job.train.node_budget == 4096 and config.num_classes == classes
    assert config.extractor == spec.get("extractor", config.extractor)
    from pipeline.tasks import make_task

    built = make_task(setup.task_name, vocab=open_split(shards, "train").vocab, **setup.task_state)
    torch.manual_seed(0)
    model = SAT(config)
    dataset = open_split(shards, "train")
    batch = BatchCollator(config, node_targets=built.node_level)([dataset[i] for i in range(4)])
    loss = built.loss(model(batch), batch)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
def test_gpu_step_benchmark_times_the_products_trainer_on_cpu(tmp_path):
    """`python -m benchmarks.gpu.step` on a CPU (tiny model, ~1 min on 2 busy cores): warm-up, the
    timed window, the profiled and the FLOP-counted steps of the product's trainer, one JSON line."""
    spec = {"job": "jobs/pattern.yaml", "tiny": True, "max_graphs": 4, "bucket_size": 4, "node_budget": 10**6,
            "precision": "fp32", "seconds": 0.5, "warmup": 2, "loader_workers": 0, "top_ops": 2}
    spec["shards"] = str(job_shards(job_for(spec), tmp_path / "shards", 24))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", OUTDATED_IGNORE="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the trainer's LocalContext sets them (a group of one on a free port)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.step", json.dumps(spec)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["steps"] >= 4 and r["graphs_per_s"] > 0 and r["graphs_per_step"] == 4 and r["step_mode"] == "eager"
    assert 0 <= r["data_wait_frac"] < 1 and r["precision"] == "fp32" and r["flops_per_graph"] > 0
    assert len(r["top_host_ops"]) == 2 and "host_syncs_per_step" in r


@pytest.mark.slow
def test_scale_benchmark_row_for_a_tiny_size(tmp_path, monkeypatch):
    """`BENCH=scale` at 60 graphs: generate, preprocess (its own local Ray) and the finished rerun as
    subprocesses; one table row, every figure positive, the size's directory removed (~65 s on 2 busy cores)."""
    from benchmarks.scale import data_path as bench_scale

    monkeypatch.setenv("SATP_SCALE_DIR", str(tmp_path))
    text = bench_scale.run([60], kill_after=0)
    header = next(line for line in text.splitlines() if line.startswith("| graphs |"))
    rows = [line for line in text.splitlines() if line.startswith("| 60 |")]
    assert len(rows) == 1, text
    names, values = ([c.strip() for c in line.strip("|").split("|")] for line in (header, rows[0]))
    cells = dict(zip(names, values))
    for key in ("generate s", "generate peak RSS MiB", "preprocess s", "driver peak RSS MiB",
                "largest Ray worker peak RSS MiB", "finished rerun s", "raw MiB", "columnar MiB", "shards MiB"):
        assert float(cells[key].replace(",", "")) > 0, (key, cells)
    assert float(cells["object store peak MiB"].rstrip("*").replace(",", "")) >= 0
    assert cells["killed at"] == cells["resume s"] == "-"
    assert "60 graphs in the manifest" in text and "nproc" in text and "Load average" in text
    assert "satp preprocess jobs/ppa.yaml --set data.root=D/data" in text
    assert list(tmp_path.iterdir()) == []


def test_gpu_accuracy_fast_variant_scales_batch_lr_and_warmup(monkeypatch):
    """`SATP_ACC_FAST=1` (benchmarks/gpu/accuracy_sbm.py): 4x the job's batch, lr by the square-root rule,
    a quarter of the warm-up in epochs; without it the part runs the job file's settings."""
    from benchmarks.gpu.accuracy_sbm import sbm_variant
    from pipeline.config import load_job

    job = load_job("jobs/pattern.yaml")
    for key in ("SATP_ACC_FAST", "SATP_ACC_BATCH", "SATP_ACC_LR", "SATP_ACC_WARMUP_STEPS", "SATP_ACC_SET"):
        monkeypatch.delenv(key, raising=False)
    assert sbm_variant(job)[:2] == ("job", [])
    monkeypatch.setenv("SATP_ACC_FAST", "1")
    label, sets, _ = sbm_variant(job)
    assert label == "fast"
    assert sets == ["train.max_graphs_per_batch=128", "train.bucket_size=128", "train.node_budget=25600",
                    "train.lr=0.0006", "train.warmup_steps=312"]
    fast = load_job("jobs/pattern.yaml", sets)
    assert fast.train.max_graphs_per_batch == 128 and fast.train.lr == 6e-4


def test_gpu_accuracy_curve_shows_the_running_bn_metric_when_the_run_has_it():
    """With train.precise_bn_batches the curve has columns for the validation metric under
    BatchNorm's moving averages and the statistics' shift, between validation and test; without,
    the table is as before."""
    from benchmarks.gpu.accuracy_report import curve_table

    plain = [{"epoch": 0, "val_acc": 0.8, "test_acc": 0.79}]
    both = [{"epoch": 0, "val_acc": 0.85, "val_acc_running_bn": 0.78, "bn_var_ratio": 1.31, "bn_mean_shift": 0.12,
             "test_acc": 0.84}]
    rows = curve_table(plain, "acc", {})
    assert "running BN" not in rows[0] and all(r.count("|") == rows[0].count("|") for r in rows)
    rows = curve_table(both, "acc", {})
    assert all(r.count("|") == rows[0].count("|") == 17 for r in rows)
    header = [c.strip() for c in rows[0].split("|")]
    cells = dict(zip(header, (c.strip() for c in rows[2].split("|"))))
    assert (cells["val acc"], cells["val acc, running BN"], cells["test acc"]) == ("0.8500", "0.7800", "0.8400")
    assert (cells["BN var ratio"], cells["BN mean shift"]) == ("1.310", "0.120")


def test_gpu_accuracy_code2_subset_fits_the_time_left():
    """code2batch's N: 3 recipe epochs at 85% of the probe's rate fit what is left after the default's
    reserve and both start-ups; never more than the split or the cap."""
    from benchmarks.gpu import accuracy_code2 as acc

    n, sizing = acc.choose_subset(400.0, 700.0, 100_000, 30_000, 100_000)
    epochs_s = acc.RECIPE_EPOCHS * n / (0.85 * 700.0)
    assert 0 < n < 100_000 and epochs_s <= sizing["recipe_train_room_s"] + 1
    assert acc.choose_subset(10_000.0, 700.0, 80_000, 30_000, 100_000)[0] == 80_000
    assert acc.choose_subset(10.0, 700.0, 80_000, 30_000, 100_000)[0] == 1


def test_gpu_accuracy_never_builds_from_reserved_packages():
    from benchmarks.gpu.accuracy_code2 import package_dirs

    dirs, skipped = package_dirs(["json", "IPython", "no_such_package_xyz"])
    assert len(dirs) == 1 and dirs[0].endswith("json")
    assert any(s.startswith("IPython (reserved") for s in skipped) and any("not installed" in s for s in skipped)


def test_measure_stops_a_command_when_asked_with_sigint_first(tmp_path):
    """benchmarks.gpu.measure.measure's stop predicate: SIGINT, the grace period, then the process tree is killed."""
    import sys
    import time

    from benchmarks.gpu.measure import measure

    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGINT, lambda *a: (print('got SIGINT', flush=True), sys.exit(3)))\n"
              "print('up', flush=True)\ntime.sleep(60)\n")
    started = time.monotonic()
    calls = []

    def stop():
        calls.append(1)
        return "asked" if len(calls) >= 2 else None

    r = measure([sys.executable, "-c", script], 60, tmp_path / "cmd.log", should_stop=stop, check_s=0.2, grace_s=5)
    assert r["stopped"] == "asked" and not r["ok"] and not r["timed_out"] and r["returncode"] == 3
    assert "got SIGINT" in (tmp_path / "cmd.log").read_text() and time.monotonic() - started < 20


def test_batch_study_interpolates_the_crossing_and_fits_the_critical_batch():
    """benchmarks/accuracy/batch.py: the first crossing of a target, linear between evaluations (only a
    bound when the first one reaches it); the fit S(G) = S_min (1 + G_crit / G) recovers exact points'
    parameters and refuses two points."""
    from benchmarks.accuracy.batch import first_crossing, fit_critical

    assert first_crossing([10, 20, 30], [0.1, 0.3, 0.5], 0.4) == (pytest.approx(25.0), False)
    assert first_crossing([10, 20], [0.5, 0.6], 0.4) == (10, True)
    assert first_crossing([10, 20], [0.1, 0.2], 0.4) == (None, False)
    s_min, g_crit = fit_critical([(g, 7 * (1 + 550 / g)) for g in (32, 128, 512, 2048)])
    assert (s_min, g_crit) == (pytest.approx(7), pytest.approx(550))
    assert fit_critical([(32, 100.0), (128, 30.0)]) is None
