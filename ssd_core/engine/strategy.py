"""The strategy interface: what a strategy is told, and what it answers (and the router's answer,
`Route`, which a plan carries: the engine knows its shape, not the router that makes it).

`start` is called once after prefill and returns a `Plan` (where the prompt was routed, the first
skip set); `choose` is called before every step and returns a `Decision` (the set to draft with, or
None for an autoregressive step); `update` is told each step's outcome. The decode loop copies the
plan into its `Start` event and each decision's note and forecast into that step's `Step` event, so
the app, the bench and the tests read what happened from the events, never from a strategy.
"""
from __future__ import annotations

from dataclasses import dataclass

from .skipset import SkipSet


@dataclass(frozen=True)
class Neighbour:
    """One of the K nearest anchors of a query."""

    text: str          # prompt text of the anchor ("" for a centroid)
    domain: str
    similarity: float  # cosine similarity to the query
    kind: str          # "prompt" or "centroid"
    index: int         # row in the anchor table

    def to_dict(self) -> dict:
        return {"text": self.text, "domain": self.domain, "similarity": self.similarity,
                "kind": self.kind, "index": self.index}


@dataclass(frozen=True)
class Route:
    """The router's answer (calibration.router.Router.route) for one prompt, with everything the UI needs to explain it."""

    domain: str | None                  # None = unknown domain (below threshold) → fallback set
    votes: dict[str, float]             # domain → vote weight among the K nearest anchors
    neighbours: tuple[Neighbour, ...]   # the K nearest anchors, best first
    similarity: float                   # similarity of the nearest anchor
    skip: SkipSet                       # the chosen set (domain's set or the fallback)
    unknown: bool
    vote: str = "weighted"
    threshold: float = 0.5

    def describe(self) -> str:
        if self.unknown:
            return (f"unknown domain (best similarity {self.similarity:.2f} < {self.threshold:.2f})"
                    f" → {self.skip.name or 'static'} set")
        agree = sum(n.domain == self.domain for n in self.neighbours)
        weight = "" if self.vote == "majority" else f", weight {self.votes[self.domain]:.2f}"
        return (f"routed to {self.domain} ({agree}/{len(self.neighbours)} votes{weight}, "
                f"similarity {self.similarity:.2f})")

    def to_dict(self) -> dict:
        return {"domain": self.domain, "votes": dict(self.votes),
                "neighbours": [n.to_dict() for n in self.neighbours],
                "similarity": self.similarity, "skip": self.skip.to_dict(),
                "unknown": self.unknown, "vote": self.vote, "threshold": self.threshold,
                "description": self.describe()}



@dataclass(frozen=True)
class Forecast:
    """The latency model's prediction for a skip set, made before drafting with it."""

    skip: SkipSet
    acceptance: float          # the acceptance the prediction assumes
    predicted_speedup: float   # tokens per unit time vs autoregressive (latency.expected_speedup)
    context_len: int           # the context length it was made at

    @property
    def speculate(self) -> bool:
        """Whether speculating with this set is predicted to beat autoregressive decoding."""
        return self.predicted_speedup >= 1.0


@dataclass(frozen=True)
class Plan:
    """A strategy's answer after prefill (all None for autoregressive decoding)."""

    skip: SkipSet | None = None        # the first set it will draft with, when it knows it already
    domain: str | None = None          # the domain it drafts for (knn: the routed one; oracle: the given one)
    route: Route | None = None         # knn: the router's answer, with its votes and neighbours
    forecast: Forecast | None = None   # auto: the prediction it starts from


@dataclass(frozen=True)
class Decision:
    """A strategy's answer for one step: the skip set to draft with, or None for autoregressive."""

    skip: SkipSet | None
    note: str = ""
    forecast: Forecast | None = None   # set when the strategy (re)chose its set on a prediction


class Strategy:
    """Which sublayers to skip for this prompt, now. Subclasses override `start` / `choose`."""

    name = "ar"
    # how many tokens to draft this step (policies.adaptive.AdaptiveLength; None → DecodeConfig.gamma)
    length = None

    def start(self, backbone, prompt, embedding) -> Plan:
        """Called after prefill with the prompt's embedding."""
        return Plan()

    def choose(self, state) -> Decision:
        """state: the live engine.decode.DecodeState."""
        return Decision(None)

    def update(self, step) -> None:
        """Told each step's outcome (an engine.decode.Step), e.g. to adapt."""
