"""What one request to a served model may ask of it: caps on its size (:data:`SETTINGS`), and a deadline.

``mlflow models serve`` answers 504 at its timeout while its thread works on, and a graph costs the
square of its nodes: so a request over a cap is refused before any graph is built, and its work stops
at the deadline (checked between functions and batches)."""
from __future__ import annotations

import dataclasses
import math
import os
import time

#: field -> (environment variable of the serving process, default)
SETTINGS = {
    "source_bytes": ("SATP_SERVE_MAX_SOURCE_BYTES", 1_000_000),
    "graphs": ("SATP_SERVE_MAX_GRAPHS", 2_000),
    "graph_nodes": ("SATP_SERVE_MAX_GRAPH_NODES", 5_000),
    "nodes": ("SATP_SERVE_MAX_NODES", 100_000),
}
TIMEOUT_SETTING = "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"


class TooLarge(ValueError):
    """A request over a cap: its line names the cap's setting (answered 413)."""


class PastDeadline(TimeoutError):
    """A request still at work when its deadline passed (answered 504, as MLflow has already)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """The caps of one request and its time."""

    source_bytes: int
    graphs: int
    graph_nodes: int
    nodes: int
    seconds: float

    @classmethod
    def from_environment(cls) -> "Limits":
        """The caps the settings give (a setting that is not a positive integer: one-line ``ValueError``)."""
        from mlflow.environment_variables import MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT

        values = {}
        for field, (setting, default) in {**SETTINGS, "seconds": (TIMEOUT_SETTING,
                                                                   MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.default)}.items():
            text = os.environ.get(setting, str(default)).strip()
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"{setting}={os.environ.get(setting)!r}: expected a positive integer")
            values[field] = int(text)
        return cls(**values)


class Budget:
    """One request's account: what it asked for so far against the caps, and its deadline."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.source_bytes = self.graphs = self.nodes = 0

    def source(self, text: str, where: str) -> None:
        """Count ``text`` (one input's source) against the request's bytes of source."""
        self.source_bytes += len(text.encode("utf-8", errors="surrogatepass"))
        cap = self.limits.source_bytes
        if self.source_bytes > cap:
            raise TooLarge(f"{where}: the request holds more than {cap:,} bytes of source "
                           f"({self.source_bytes:,} so far; {SETTINGS['source_bytes'][0]}): send fewer or smaller sources")

    def graph(self, nodes: int, where: str) -> None:
        """Count one graph of ``nodes`` nodes (``where``: which input, function or graph it is)."""
        self.graphs += 1
        self.nodes += nodes
        if self.graphs > self.limits.graphs:
            raise TooLarge(f"{where}: the request holds more than {self.limits.graphs:,} graphs "
                           f"({SETTINGS['graphs'][0]}; code2: one per function): send fewer per request")
        if nodes > self.limits.graph_nodes:
            raise TooLarge(f"{where}: {nodes:,} nodes, more than the {self.limits.graph_nodes:,} of one graph "
                           f"({SETTINGS['graph_nodes'][0]})")
        if self.nodes > self.limits.nodes:
            raise TooLarge(f"{where}: the request holds more than {self.limits.nodes:,} nodes "
                           f"({self.nodes:,} so far; {SETTINGS['nodes'][0]}): send fewer or smaller graphs per request")

    def check_time(self) -> None:
        """Stop the request's work once its deadline passed."""
        if time.monotonic() > self.deadline:
            raise PastDeadline(f"the request ran past {self.limits.seconds:g} s ({TIMEOUT_SETTING}); its work stopped")


#: no caps and no deadline (a library call's default; counting in it is harmless)
UNLIMITED = Budget(Limits(math.inf, math.inf, math.inf, math.inf, math.inf))
