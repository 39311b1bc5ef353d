"""``satp data ...`` and ``satp preprocess`` (filled in by the preprocessing work)."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    del sub
