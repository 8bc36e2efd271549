"""The search space: which sublayers may be skipped, and the candidate sets a search starts from.

The first and last layers are never skipped: they map tokens into and out of the residual stream and
skipping them wrecks every draft. A set is encoded for optuna (speed mode) as one boolean per sublayer.
"""
from __future__ import annotations

import random

from ..engine.skipset import SkipSet


def from_slots(chosen, name: str = "") -> SkipSet:
    """A set from (kind, layer) slots."""
    return SkipSet(frozenset(i for k, i in chosen if k == "attn"),
                   frozenset(i for k, i in chosen if k == "mlp"), name=name)


# --- search space ------------------------------------------------------------------------------------
def searchable_layers(n_layers: int) -> range:
    """Layers whose sublayers may be skipped: all but the first and the last."""
    if n_layers < 3:
        raise ValueError(f"a model with {n_layers} layers has no skippable middle layers")
    return range(1, n_layers - 1)


def searchable_slots(n_layers: int) -> list[tuple[str, int]]:
    """Every skippable sublayer as (kind, layer), in layer order."""
    return [(kind, i) for i in searchable_layers(n_layers) for kind in ("attn", "mlp")]


def _middle(n_layers: int) -> list[int]:
    """The middle half of the searchable layers (the part Self-SD / SWIFT find most redundant)."""
    inner = list(searchable_layers(n_layers))
    lo, hi = n_layers // 4, max(n_layers // 4 + 1, (3 * n_layers) // 4)
    return [i for i in inner if lo <= i < hi] or inner


def default_initial(n_layers: int) -> SkipSet:
    """A cheap, usually decent starting point: every other middle attention sublayer."""
    return SkipSet(frozenset(_middle(n_layers)[::2]), frozenset(), name="initial")


def initial_with(n_layers: int, count: int) -> SkipSet:
    """A starting set of `count` sublayers: middle attentions first, then upper, then middle MLPs."""
    inner = list(searchable_layers(n_layers))
    mid = _middle(n_layers)
    order = [("attn", i) for i in mid[::2]] + [("attn", i) for i in inner[len(inner) // 2:]] + \
            [("attn", i) for i in mid] + [("mlp", i) for i in mid[1::2]] + \
            [(k, i) for i in inner for k in ("attn", "mlp")]
    chosen = list(dict.fromkeys(order))[:count]
    return from_slots(chosen, "initial")


def structured_candidates(n_layers: int) -> list[SkipSet]:
    """Hand-shaped sets worth one trial each: they cover regions random sampling rarely hits."""
    mid = _middle(n_layers)
    inner = list(searchable_layers(n_layers))
    upper = inner[len(inner) // 2:]
    shapes = [(mid[::4], []), (mid[::2], []), ([], mid[1::2]), (mid, []), ([], mid[::2]),
              (upper[::2], []), (upper, []), (mid[::2], mid[::2]), (mid, mid[1::2])]
    return [SkipSet(frozenset(a), frozenset(m)) for a, m in shapes]


def random_candidates(n_layers: int, n: int, seed: int = 0, min_skipped: int = 1) -> list[SkipSet]:
    """Random sets whose density varies from about `min_skipped` sublayers to half of them.

    Uniform random bits (what optuna would draw) all skip about half the model; on hardware where
    only a few skipped sublayers pay off, that region would never be seen before TPE starts.
    """
    rng = random.Random(seed)
    slots = searchable_slots(n_layers)
    out = []
    for _ in range(n):
        low = min(max(1, min_skipped) / len(slots), 0.5)
        density = rng.uniform(low, max(low, 0.5) if min_skipped <= 1 else min(0.6, low * 1.6))
        chosen = [slot for slot in slots if rng.random() < density] or [rng.choice(slots)]
        out.append(from_slots(chosen))
    return out


def ratio_count(n_layers: int, ratio: float) -> int:
    """Sublayers a set skips at `ratio` of the 2·L sublayers (at least 1, at most all searchable)."""
    if not 0 < ratio < 1:
        raise ValueError(f"skip ratio must be in (0, 1), got {ratio}")
    return min(max(1, round(ratio * 2 * n_layers)), 2 * len(searchable_layers(n_layers)))


def trial_params(skip: SkipSet, n_layers: int) -> dict[str, bool]:
    """A set as optuna trial parameters (to enqueue it as a trial)."""
    return {f"{kind}_{i}": i in getattr(skip, kind)
            for i in searchable_layers(n_layers) for kind in ("attn", "mlp")}


def suggest_set(trial, n_layers: int, name: str) -> SkipSet:
    """The set an optuna trial proposes (speed mode)."""
    chosen = {"attn": set(), "mlp": set()}
    for i in searchable_layers(n_layers):
        for kind in ("attn", "mlp"):
            if trial.suggest_categorical(f"{kind}_{i}", (False, True)):
                chosen[kind].add(i)
    return SkipSet(frozenset(chosen["attn"]), frozenset(chosen["mlp"]), name=name)


def check_initial(skip: SkipSet, n_layers: int, min_skipped: int) -> None:
    """Refuse an initial set the search itself could never propose."""
    skip.validate(n_layers)
    edge = {0, n_layers - 1}
    if (skip.attn | skip.mlp) & edge:
        raise ValueError(f"the initial set {skip} skips the first or last layer, which the search "
                         "never does")
    if len(skip) < min_skipped:
        raise ValueError(f"the initial set {skip} skips fewer than min_skipped={min_skipped} "
                         "sublayers (pass min_skipped=0 to allow it)")
