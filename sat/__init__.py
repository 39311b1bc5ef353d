"""sat: the Structure-Aware Transformer (Chen, O'Bray, Borgwardt, ICML 2022) as a model library.

Pure torch + torch_geometric. Build a model with ``SAT(SATConfig(...))`` and run it on a PyG
batch of :class:`SATData`; see ``docs/python_api.md``. The names below are imported on first use,
so that ``sat.config`` (read by job-file validation) loads without torch.
"""
from importlib import import_module

_EXPORTS = {
    "StructureAwareAttention": ".attention",
    "SATConfig": ".config",
    "SATData": ".data",
    "add_subgraph_indices": ".data",
    "k_hop_subgraph_indices": ".data",
    "incident_edge_sum": ".encodings",
    "laplacian_pe": ".encodings",
    "node_degree": ".encodings",
    "random_walk_pe": ".encodings",
    "SubgraphExtractor": ".extractors",
    "SubtreeExtractor": ".extractors",
    "SATLayer": ".layers",
    "GraphLayout": ".layout",
    "Capacity": ".padding",
    "pad_batch": ".padding",
    "SAT": ".model",
    "validate_batch": ".validation",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
