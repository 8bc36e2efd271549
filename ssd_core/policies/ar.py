"""Autoregressive decoding: the baseline every speedup is measured against."""
from __future__ import annotations

from ..engine.strategy import Strategy


class Autoregressive(Strategy):
    """Plain decoding: every step is one full forward."""

    name = "ar"
