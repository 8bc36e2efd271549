"""The static set: the same skip set for every prompt (the Self-SD baseline)."""
from __future__ import annotations

from ..engine.skipset import SkipSet
from ..engine.strategy import Decision, Plan, Strategy


class Static(Strategy):
    """Always draft with the same skip set."""

    name = "static"

    def __init__(self, skip: SkipSet, name: str | None = None):
        self.skip = skip
        if name:
            self.name = name

    def start(self, backbone, prompt, embedding) -> Plan:
        self.skip.validate(backbone.n_layers)
        return Plan(skip=self.skip)

    def choose(self, state) -> Decision:
        return Decision(self.skip)
