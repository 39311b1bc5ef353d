"""sat: the Structure-Aware Transformer (Chen, O'Bray, Borgwardt, ICML 2022) as a model library.

Pure torch + torch_geometric. Build a model with ``SAT(SATConfig(...))`` and run it on a PyG
batch of :class:`SATData`; see ``docs/python_api.md``.

The names below are imported on first use (module ``__getattr__``), so that ``sat.config`` (a
plain dataclass, read by job-file validation) loads without torch and torch_geometric: the
``satp`` command validates a job and prints its help in well under a second.
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

__all__ = [
    "SAT",
    "SATConfig",
    "SATData",
    "add_subgraph_indices",
    "k_hop_subgraph_indices",
    "random_walk_pe",
    "laplacian_pe",
    "incident_edge_sum",
    "node_degree",
    "StructureAwareAttention",
    "GraphLayout",
    "Capacity",
    "pad_batch",
    "SubtreeExtractor",
    "SubgraphExtractor",
    "SATLayer",
    "validate_batch",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
