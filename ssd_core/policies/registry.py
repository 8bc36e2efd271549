"""The one list of strategies: their names, their labels in words, and how to build one.

Everything that offers, runs or shows strategies (the bench, scaling, the calibration, the views)
takes the names and labels from here. `build` makes a fresh strategy from a calibration: strategies
hold per-request state, so every request gets its own.
"""
from __future__ import annotations

from .adaptive import AdaptiveLength
from .ar import Autoregressive
from .auto import Auto
from .knapspec import KnapSpec
from .knn import KnnStrategy
from .oracle import Oracle
from .static import Static

STRATEGIES = ("ar", "static", "knn", "oracle", "knapspec", "auto")
LABELS = {"ar": "autoregressive", "static": "static set", "knn": "KNN-SSD", "oracle": "oracle",
          "knapspec": "KnapSpec", "auto": "auto (falls back to AR)"}
BASELINE = "ar"                                          # every speedup is a ratio against it
AUTO_INNER = ("static", "knn", "oracle", "knapspec")     # what `auto` may wrap
# the strategies that always speculate (the bench's default set, beside the baseline)
SPECULATIVE = tuple(n for n in STRATEGIES if n not in (BASELINE, "auto"))


def parse_strategies(text_or_list) -> list[str]:
    """Names from "knn,static" or a list: checked, without repeats, the baseline first."""
    items = text_or_list.split(",") if isinstance(text_or_list, str) else text_or_list
    names = [s.strip() for s in items if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    names = list(dict.fromkeys(names))
    return [BASELINE] + [n for n in names if n != BASELINE]


def build(cal, name: str, *, gamma: int = 4, k: int | None = None, vote: str | None = None,
          threshold: float | None = None, domain: str | None = None, category: str | None = None,
          inner: str = "knn", every: int = 32, draft: str = "int8", adaptive: bool = True):
    """A fresh strategy `name` from a calibration.Calibration.

    k / vote / threshold: the router's settings (knn); domain or category: the oracle's domain;
    inner: what auto wraps (one of AUTO_INNER); every: KnapSpec's re-optimisation period in steps;
    draft: the draft weights the decode will use (DecodeConfig.draft), so that costs and acceptance
    come from that kind; adaptive: the latency model picks γ ≤ gamma every step.
    """
    strategy = _build(cal, name, gamma=gamma, k=k, vote=vote, threshold=threshold, domain=domain,
                      category=category, inner=inner, every=every, draft=draft)
    if adaptive and name not in (BASELINE, "auto"):
        strategy.length = AdaptiveLength(cal.latency, draft)
    return strategy


def _build(cal, name, *, gamma, k, vote, threshold, domain, category, inner, every, draft):
    if name == "ar":
        return Autoregressive()
    if name == "static":
        return Static(cal.static)
    if name == "knn":
        return KnnStrategy(cal.router, k=k, vote=vote, threshold=threshold)
    if name == "oracle":
        oracle = Oracle(cal.domain_sets, cal.static, domain)
        return oracle.for_category(category) if category is not None else oracle
    if name == "knapspec":
        full = cal.acceptance(draft).get("full", 1.0)
        return KnapSpec(cal.latency, gamma, kappa=cal.knapspec.get("kappa", 8.0), every=every,
                        kind=draft, agreement=full)
    if name == "auto":
        if inner not in AUTO_INNER:
            raise ValueError(f"auto wraps one of {', '.join(AUTO_INNER)}, not {inner!r}")
        base = _build(cal, inner, gamma=gamma, k=k, vote=vote, threshold=threshold, domain=domain,
                      category=category, inner=inner, every=every, draft=draft)
        return Auto(base, cal.latency, cal.acceptance(draft), gamma, kind=draft)
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
