"""The GPU train-step benchmark's own parts (benchmarks/gpu/step.py), on CPU: its graph files and
the job, task and model it builds, as the worker does."""
import pytest
import torch

from benchmarks.gpu.step import _job_parts, load_graphs, save_graphs
from benchmarks.graphs.synthetic import code2_like_graphs, ppa_like_graphs
from pipeline.train.loader import BatchCollator
from sat import SAT, add_subgraph_indices


def _tensors(graph) -> dict:
    return {k: v for k, v in graph.items() if torch.is_tensor(v)}


@pytest.mark.parametrize("kind", ["code2", "code2 k=2", "ppa"])
def test_graph_files_read_back_every_graph_exactly(kind, tmp_path):
    graphs = ppa_like_graphs(5, seed=1) if kind == "ppa" else code2_like_graphs(7, seed=1)
    if kind == "code2 k=2":
        graphs = [add_subgraph_indices(g, 2) for g in graphs]
    save_graphs(graphs, tmp_path / "graphs.pt")
    back = load_graphs(tmp_path / "graphs.pt")
    assert [g.num_nodes for g in back] == [g.num_nodes for g in graphs]
    for g, h in zip(graphs, back):
        assert _tensors(g).keys() == _tensors(h).keys()
        for key, value in _tensors(g).items():
            assert h[key].dtype == value.dtype and torch.equal(h[key], value), key


@pytest.mark.parametrize("job, task", [("code2.yaml", "code2"), ("ppa.yaml", "ppa")])
def test_gpu_step_benchmark_trains_each_job_with_its_own_task(job, task):
    graphs = code2_like_graphs(4, seed=0) if task == "code2" else ppa_like_graphs(4, seed=0)
    built, config, train = _job_parts({"job": f"jobs/{job}", "node_budget": 4096, "tiny": True}, graphs)
    assert built.name == task and train.node_budget == 4096
    assert config.num_classes == (5002 if task == "code2" else 37)
    torch.manual_seed(0)
    model = SAT(config)
    batch = BatchCollator(config)(graphs)
    loss = built.loss(model(batch), batch)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


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
    """`SATP_ACC_FAST=1` (benchmarks/gpu/accuracy.py): 4x the job's batch, lr by the square-root rule,
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
