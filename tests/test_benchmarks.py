"""The GPU train-step benchmark's own parts (benchmarks/gpu_step.py), on CPU: its graph files and
the job, task and model it builds, as the worker does."""
import pytest
import torch

from benchmarks.gpu_step import _job_parts, load_graphs, save_graphs
from benchmarks.synthetic import code2_like_graphs, ppa_like_graphs
from pipeline.loader import BatchCollator
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
    from benchmarks import bench_scale

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
