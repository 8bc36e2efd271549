"""Strategies: small interchangeable objects that answer "which sublayers to skip now".

The decode loop never branches on which one it runs (see decode.Strategy).
Router-based (knn), knapspec and auto strategies live beside their science in
router.py, knapspec.py and latency.py.
"""
from __future__ import annotations

from .decode import Decision, Strategy
from .skipset import SkipSet


class Autoregressive(Strategy):
    """Plain decoding: every step is one full forward."""

    name = "ar"


class Static(Strategy):
    """Always draft with the same skip set (the Self-SD baseline)."""

    name = "static"

    def __init__(self, skip: SkipSet, name: str | None = None):
        self.skip = skip
        if name:
            self.name = name

    def start(self, backbone, prompt, embedding) -> dict:
        self.skip.validate(backbone.n_layers)
        return {"skip": self.skip.to_dict()}

    def choose(self, state) -> Decision:
        return Decision(self.skip)


# Category → domain map of the oracle strategy (DESIGN.md §4).
ORACLE_CATEGORY_DOMAIN = {
    "translation": "translation",
    "summarization": "summarization",
    "math_reasoning": "math",
    "math": "math",
    "qa": "qa",
    "rag": "qa",
    "coding": "code",
    "code": "code",
    "writing": "story",
    "roleplay": "story",
    "story": "story",
    "sql": "sql",
}


class Oracle(Strategy):
    """Draft with the set of the domain the prompt is known to belong to."""

    name = "oracle"

    def __init__(self, domain_sets: dict[str, SkipSet], fallback: SkipSet, domain: str | None = None):
        self.domain_sets = domain_sets
        self.fallback = fallback
        self.domain = domain

    def for_category(self, category: str | None) -> "Oracle":
        domain = ORACLE_CATEGORY_DOMAIN.get((category or "").lower())
        return Oracle(self.domain_sets, self.fallback, domain)

    def _skip(self) -> SkipSet:
        return self.domain_sets.get(self.domain, self.fallback) if self.domain else self.fallback

    def start(self, backbone, prompt, embedding) -> dict:
        skip = self._skip()
        return {"domain": self.domain if self.domain in self.domain_sets else None,
                "skip": skip.to_dict()}

    def choose(self, state) -> Decision:
        return Decision(self._skip())
