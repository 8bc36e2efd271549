"""Auto: speculate only where the latency model predicts a gain; decode autoregressively elsewhere."""
from __future__ import annotations

from dataclasses import replace

from ..calibration.latency import LatencyModel
from .adaptive import AdaptiveLength
from ..engine.strategy import Decision, Forecast, Plan, Strategy


class Auto(Strategy):
    """Wraps a strategy; decodes autoregressively whenever the latency model predicts a loss.

    Before the first step it predicts with the calibration's acceptance for the first set the inner
    strategy plans (its `Plan.skip`; KnapSpec chooses its first set at the first step, so it starts
    without a prediction); then with the acceptance measured in this run (its `length` controller).
    While the prediction is below 1× it decodes autoregressively, trying one speculative step every
    `probe_every` steps so the estimate can recover.
    """

    name = "auto"

    def __init__(self, inner: Strategy, latency: LatencyModel, acceptance: dict[str, float],
                 gamma: int, default_acceptance: float = 0.5, kind: str = "fp32", probe_every: int = 8):
        self.inner, self.latency, self.acceptance = inner, latency, acceptance
        self.gamma, self.default_acceptance = gamma, default_acceptance
        self.kind, self.probe_every = kind, probe_every
        self.length = AdaptiveLength(latency, kind)
        self._ar_run = 0

    def start(self, backbone, prompt, embedding) -> Plan:
        plan = self.inner.start(backbone, prompt, embedding)
        self._ar_run = 0
        if plan.skip is None:
            return plan
        skip = plan.skip
        acc = self.acceptance.get(skip.name, self.default_acceptance)
        self.length = AdaptiveLength(self.latency, self.kind, prior=acc)
        gamma = self.latency.best_gamma(skip, acc, self.gamma, len(prompt), self.kind)
        pred = self.latency.expected_speedup(skip, acc, gamma, len(prompt), self.kind)
        return replace(plan, forecast=Forecast(skip, acc, pred, len(prompt)))

    def choose(self, state) -> Decision:
        decision = self.inner.choose(state)
        if decision.skip is None:           # the inner strategy decodes autoregressively itself
            return Decision(None, note=decision.note or "auto: autoregressive")
        acc = self.length.acceptance
        ctx = state.cache.length
        gamma = self.length.gamma(decision.skip, ctx, self.gamma)
        pred = self.latency.expected_speedup(decision.skip, acc, gamma, ctx, self.kind)
        if pred < 1.0:
            self._ar_run += 1
            if self._ar_run % self.probe_every:
                return Decision(None, note=f"auto: predicted {pred:.2f}× at acceptance {acc:.2f} → "
                                           "autoregressive")
        else:
            self._ar_run = 0
        return decision

    def update(self, step) -> None:
        self.inner.update(step)
