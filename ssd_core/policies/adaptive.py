"""Adaptive draft length: γ per step from the latency model and the acceptance seen in this run."""
from __future__ import annotations

from ..calibration.latency import LatencyModel
from ..engine.skipset import SkipSet


class AdaptiveLength:
    """Chooses γ for each step from the measured costs and the acceptance seen so far in this run.

    The acceptance estimate is a decayed count of accepted / tried draft positions (a rejected
    position counts as one trial; positions after it were never tried), started from a prior. Lookup
    drafts are not counted: they come from the prompt, not from the draft model.
    """

    def __init__(self, latency: LatencyModel, kind: str = "fp32", prior: float = 0.7,
                 weight: float = 4.0, decay: float = 0.9):
        self.latency, self.kind, self.decay = latency, kind, decay
        self.hits, self.trials = prior * weight, weight

    @property
    def acceptance(self) -> float:
        return self.hits / self.trials

    def gamma(self, skip: SkipSet, context_len: int, max_gamma: int) -> int:
        return self.latency.best_gamma(skip, self.acceptance, max_gamma, context_len, self.kind)

    def update(self, step) -> None:
        if step.source != "model":
            return
        tried = step.accepted + (1 if step.accepted < len(step.drafted) else 0)
        self.hits = self.decay * self.hits + step.accepted
        self.trials = self.decay * self.trials + tried
