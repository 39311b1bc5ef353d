"""sat: the Structure-Aware Transformer (Chen, O'Bray, Borgwardt, ICML 2022) as a model library.

Pure torch + torch_geometric. Build a model with ``SAT(SATConfig(...))`` and run it on a PyG
batch of :class:`SATData`; see ``docs/python_api.md``.
"""
from .attention import StructureAwareAttention
from .config import SATConfig
from .data import SATData, add_subgraph_indices, k_hop_subgraph_indices
from .encodings import incident_edge_sum, laplacian_pe, node_degree, random_walk_pe
from .extractors import SubgraphExtractor, SubtreeExtractor
from .layers import SATLayer
from .layout import GraphLayout
from .model import SAT
from .validation import validate_batch

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
    "SubtreeExtractor",
    "SubgraphExtractor",
    "SATLayer",
    "validate_batch",
]
