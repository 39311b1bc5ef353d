"""The model compiles as one graph on fixed-capacity batches (train.step: compiled / captured).

* Every job file's model traces on a padded batch of its own data layout with zero graph breaks
  (``torch._dynamo.explain``): no data-dependent operator (``nonzero``, ``.item()``, PyG's
  ``add_remaining_self_loops``) and nothing Python-only (PyG's ``num_nodes``) is left in the forward.
* Compiled (dynamo + AOTAutograd with the ``aot_eager`` backend: the same graph capture and autograd
  as Inductor, without its C++ code generation, which takes minutes on 2 cores), a few training
  steps over two padded batches of one capacity give the eager losses and weights, and the second
  batch reuses the first one's graph (no recompilation).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch_geometric.data import Batch

from benchmarks.graphs.jobs import job_graphs
from pipeline.config import load_job
from sat import SAT
from sat.padding import Capacity, batch_counts, pad_batch

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def _padded_batches(job, count: int = 2, per_batch: int = 3, seed: int = 0):
    graphs, task, config = job_graphs(job, count * per_batch, seed=seed)
    batches = [Batch.from_data_list(graphs[i * per_batch:(i + 1) * per_batch]) for i in range(count)]
    subgraphs = config.needs_subgraphs
    counts = [batch_counts(b, subgraphs) for b in batches]
    top = {k: max(c[k] for c in counts) for k in counts[0]}
    capacity = Capacity(nodes=top["nodes"] + 9, edges=top["edges"] + 17, graphs=per_batch + 1,
                        graph_nodes=top["graph_nodes"], subgraph_entries=top["subgraph_entries"] + 5 if subgraphs else 0,
                        subgraph_edges=top["subgraph_edges"] + 7 if subgraphs else 0)
    padded = [pad_batch(b, capacity, task.node_level, config.readout == "cls") for b in batches]
    return padded, task, config


@pytest.mark.parametrize("job_file", sorted(p.name for p in JOBS.glob("*.yaml")))
def test_every_job_model_compiles_without_graph_breaks(job_file):
    job = load_job(JOBS / job_file, ["model.num_layers=2"])  # every layer is alike: two show the pattern
    (batch,), _task, config = _padded_batches(job, count=1)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(SAT(config).train())(batch, validate=False)
    reasons = [f"{r.reason.splitlines()[0]} ({r.user_stack[-1] if r.user_stack else '?'})" for r in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


@pytest.mark.parametrize("variant", [[], ["model.extractor=subgraph", "model.k_hops=1", "transform.k_hops=1",
                                          "model.readout=cls"]])
def test_compiled_steps_equal_eager_steps_without_recompiling(variant):
    from torch._dynamo.utils import counters

    job = load_job(JOBS / "code2-local.yaml", ["model.hidden_dim=16", "model.num_heads=2", "model.num_layers=1",
                                               "model.dropout=0.0"] + variant)
    batches, task, config = _padded_batches(job, count=2)
    torch.manual_seed(0)
    eager = SAT(config).train()
    compiled = SAT(config).train()
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compiled.compile(backend="aot_eager", dynamic=False, fullgraph=True)
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name] = []
        for batch in batches + batches:
            loss = task.loss(model(batch, validate=False), batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(float(loss.detach()))
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(compiled.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for both batches: shapes and guards unchanged
