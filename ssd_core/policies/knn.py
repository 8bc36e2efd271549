"""KNN-SSD: route the prompt once after prefill (calibration.router), then draft with that domain's set."""
from __future__ import annotations

from ..engine.strategy import Decision, Plan, Strategy


class KnnStrategy(Strategy):
    """Route the prompt's embedding to its nearest anchors' domain; draft every step with its set."""

    name = "knn"

    def __init__(self, router, k: int | None = None, vote: str | None = None,
                 threshold: float | None = None):
        self.router = router                 # calibration.router.Router
        self.settings = {"k": k, "vote": vote, "threshold": threshold}
        self.route = None                    # one instance serves one request, so this is per prompt

    def start(self, backbone, prompt, embedding) -> Plan:
        route = self.router.route(embedding, **self.settings)
        route.skip.validate(backbone.n_layers)
        self.route = route
        return Plan(skip=route.skip, domain=route.domain, route=route)

    def choose(self, state) -> Decision:
        if self.route is None:
            raise RuntimeError("KnnStrategy.choose called before start (no prompt routed yet)")
        return Decision(self.route.skip, note=f"knn: {self.route.domain or 'unknown'}")
