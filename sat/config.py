"""Typed configuration of a SAT model, buildable from a plain dict (e.g. a job YAML's ``model:``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_type_hints

Architecture = Literal["sat", "gnn"]
AttentionImpl = Literal["auto", "varlen", "dense"]
ExtractorKind = Literal["subtree", "subgraph"]
GNNType = Literal["gcn", "gin", "gine", "sage", "pna"]
MessageImpl = Literal["auto", "fused", "torch"]
NodeEncoderKind = Literal["embedding", "linear", "code2_ast", "constant"]
EdgeEncoderKind = Literal["none", "embedding", "linear"]
PEKind = Literal["none", "rwpe", "lap"]
Readout = Literal["mean", "sum", "cls"]
NormKind = Literal["batch", "layer"]
HeadKind = Literal["graph_classification", "graph_regression", "node_classification", "code2_sequence"]

EDGE_AWARE_GNNS = ("gcn", "gine", "pna")  # base GNNs that can take edge features
PNA_AGGREGATORS = ("sum", "mean", "min", "max", "var", "std")  # what PyG's PNAConv offers
PNA_SCALERS = ("identity", "amplification", "attenuation", "linear", "inverse_linear")


@dataclass(frozen=True)
class PNASettings:
    """One PNA layer's settings (Corso et al., NeurIPS 2020; PyG's ``PNAConv``).

    ``degree_histogram[d]``: the number of training nodes of in-degree ``d`` (the scalers' average
    degree). ``towers = 0`` takes the largest of 4, 2 and 1 that divides the width.
    """

    degree_histogram: tuple[int, ...]
    aggregators: tuple[str, ...] = ("mean", "min", "max", "std")
    scalers: tuple[str, ...] = ("identity", "amplification", "attenuation")
    towers: int = 0
    divide_input: bool = True

    def towers_for(self, width: int) -> int:
        return self.towers or next(t for t in (4, 2, 1) if width % t == 0)


@dataclass
class SATConfig:
    """Hyperparameters of :class:`sat.SAT` (Chen et al., ICML 2022; Table 8 for the paper's values).

    The paper's baselines (Tables 1 and 4) are settings of the same model:

    * ``architecture="gnn"``: the base GNN alone ("Base GNN" rows), ``num_layers`` of
      :class:`sat.layers.GNNLayer` with SAT's encoders, PE, readout and head; the attention, FFN and
      extractor keys are unused, and the ``cls`` readout is refused (a [CLS] node has no edges).
    * ``k_hops = 0``: the plain Transformer ("Transformer+RWPE" with ``pe="rwpe"``).
    * ``extractor="subtree"`` / ``"subgraph"`` with ``k_hops >= 1``: k-subtree and k-subgraph SAT.
    """

    architecture: Architecture = "sat"  # gnn: the base GNN alone (see above)
    # transformer
    hidden_dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    ffn_ratio: float = 2.0
    dropout: float = 0.2
    attn_dropout: float = 0.0
    attention: AttentionImpl = "auto"  # auto: varlen on CUDA in bf16/fp16, else dense (sat.attention)
    norm: NormKind = "batch"
    pre_norm: bool = False
    degree_scaling: bool = True  # x + attn / sqrt(deg); always off for the [CLS] readout
    # structure extractor
    extractor: ExtractorKind = "subtree"
    k_hops: int = 2
    gnn_type: GNNType = "gcn"
    use_edge_attr: bool = True
    concat_hops: bool = False
    # PNA (gnn_type: pna; see PNASettings); the pipeline computes the histogram from the shards when absent
    pna_degree_histogram: list[int] | None = None
    pna_aggregators: list[str] = dataclasses.field(default_factory=lambda: list(PNASettings.aggregators))
    pna_scalers: list[str] = dataclasses.field(default_factory=lambda: list(PNASettings.scalers))
    pna_towers: int = 0
    pna_divide_input: bool = True
    gnn_messages: MessageImpl = "auto"  # GCN+edge messages; auto: fused Triton kernel for k-subgraphs on CUDA
    recompute_gnn: bool = False  # extractors: rerun the base GNN in the backward pass, keep no [S, d] activations
    # inputs
    node_encoder: NodeEncoderKind = "embedding"
    node_in_dim: int = 1  # vocabulary size (embedding) or feature width (linear)
    edge_encoder: EdgeEncoderKind = "none"
    edge_in_dim: int = 0  # vocabulary size per column (embedding) or feature width (linear)
    edge_in_columns: int = 1  # embedding only: number of long columns of edge_attr, one table each
    edge_dim: int = 0  # width of edge embeddings fed to edge-aware GNNs; 0 = hidden_dim
    code2_num_node_types: int = 98
    code2_num_node_attributes: int = 10030
    code2_max_depth: int = 20
    pe: PEKind = "none"
    pe_dim: int = 0
    # output
    readout: Readout = "mean"
    head: HeadKind = "graph_classification"
    num_classes: int = 1  # classes (per position for code2_sequence), or regression targets
    max_seq_len: int = 5  # code2_sequence only

    def __post_init__(self) -> None:
        hints = get_type_hints(SATConfig)
        for f in dataclasses.fields(self):
            allowed = get_args(hints[f.name])
            value = getattr(self, f.name)
            if allowed and all(isinstance(a, str) for a in allowed) and value not in allowed:
                raise ValueError(f"model.{f.name}: expected one of {list(allowed)}, got {value!r}")
        for name in ("hidden_dim", "num_layers", "num_heads", "num_classes", "max_seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"model.{name}: expected a positive integer, got {getattr(self, name)!r}")
        if self.k_hops < 0:
            raise ValueError(f"model.k_hops: expected >= 0, got {self.k_hops}")
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                f"model.hidden_dim: {self.hidden_dim} is not divisible by model.num_heads={self.num_heads}"
            )
        if not 0.0 <= self.dropout < 1.0 or not 0.0 <= self.attn_dropout < 1.0:
            raise ValueError("model.dropout / model.attn_dropout: expected a value in [0, 1)")
        if self.pe != "none" and self.pe_dim < 1:
            raise ValueError(f"model.pe_dim: pe={self.pe!r} needs pe_dim >= 1")
        if self.node_encoder in ("embedding", "linear") and self.node_in_dim < 1:
            raise ValueError(f"model.node_in_dim: node_encoder={self.node_encoder!r} needs node_in_dim >= 1")
        if self.edge_encoder != "none" and self.edge_in_dim < 1:
            raise ValueError(f"model.edge_in_dim: edge_encoder={self.edge_encoder!r} needs edge_in_dim >= 1")
        if self.edge_in_columns < 1:
            raise ValueError(f"model.edge_in_columns: expected >= 1, got {self.edge_in_columns}")
        if self.ffn_ratio <= 0:
            raise ValueError(f"model.ffn_ratio: expected > 0, got {self.ffn_ratio}")
        if self.architecture == "gnn" and self.readout == "cls":
            raise ValueError("model.readout: 'cls' needs attention (a [CLS] node has no edges); "
                             "architecture 'gnn' takes mean or sum")
        self._check_pna()

    def _check_pna(self) -> None:
        for name, allowed in (("pna_aggregators", PNA_AGGREGATORS), ("pna_scalers", PNA_SCALERS)):
            values = list(getattr(self, name))
            if not values or any(v not in allowed for v in values):
                raise ValueError(f"model.{name}: expected a non-empty list of {list(allowed)}, got {values!r}")
        if self.pna_towers < 0 or (self.pna_towers and self.hidden_dim % self.pna_towers):
            raise ValueError(f"model.pna_towers: expected 0 or a divisor of hidden_dim={self.hidden_dim}, "
                             f"got {self.pna_towers}")
        if self.pna_degree_histogram is not None and (
                not self.pna_degree_histogram or any(int(c) < 0 for c in self.pna_degree_histogram)):
            raise ValueError("model.pna_degree_histogram: expected counts >= 0 of nodes per in-degree 0, 1, ...")

    def pna_settings(self) -> PNASettings | None:
        """The PNA layers' settings, or None before the degree histogram is known."""
        if not self.pna_degree_histogram:
            return None
        return PNASettings(tuple(int(c) for c in self.pna_degree_histogram), tuple(self.pna_aggregators),
                           tuple(self.pna_scalers), self.pna_towers, self.pna_divide_input)

    @property
    def effective_edge_dim(self) -> int:
        return self.edge_dim or self.hidden_dim

    @property
    def has_gnn(self) -> bool:
        """Whether the model runs a base GNN (a structure extractor, or the GNN alone)."""
        return self.architecture == "gnn" or self.k_hops > 0

    @property
    def uses_edge_features(self) -> bool:
        """Whether edge features reach the model (only through an edge-aware base GNN)."""
        return (
            self.has_gnn and self.edge_encoder != "none" and self.use_edge_attr and self.gnn_type in EDGE_AWARE_GNNS
        )

    @property
    def needs_subgraphs(self) -> bool:
        """Whether a batch must carry the k-hop subgraph indices (k-subgraph extractor)."""
        return self.architecture == "sat" and self.extractor == "subgraph" and self.k_hops > 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SATConfig":
        """Build from a dict, rejecting unknown keys with a message naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
