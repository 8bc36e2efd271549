"""The oracle: draft with the set of the domain the prompt is known to belong to (no routing)."""
from __future__ import annotations

from ..engine.skipset import SkipSet
from ..engine.strategy import Decision, Plan, Strategy

# Spec-Bench category → domain; any other category drafts with the static set.
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
    """Draft with the set of a given domain (the static set when there is none)."""

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

    def start(self, backbone, prompt, embedding) -> Plan:
        return Plan(skip=self._skip(), domain=self.domain if self.domain in self.domain_sets else None)

    def choose(self, state) -> Decision:
        return Decision(self._skip())
