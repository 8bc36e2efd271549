"""Greedy construction of a fixed-size skip set (matchness mode, KNN-SSD's fixed-size sets).

TPE over one score per sublayer explores a space of C(56, 12) ≈ 5·10^11 sets with a few dozen
trials; most of them land far from anything good. The greedy method reads the search data first:

1. **importance**: the matchness of skipping each searchable sublayer alone (one pass each);
2. **construction**: `count` steps; each adds, of the `shortlist` least important sublayers not yet
   skipped, the one whose addition keeps matchness highest together with those already chosen
   (so interactions between skipped sublayers count, at shortlist passes per step);
3. **swaps**: while the budget lasts, replace a chosen sublayer by a shortlisted outside one when
   that raises matchness by at least one matched token; stops when no swap helps.

The construction always runs to the end (n + (count − 1)·shortlist passes at most; memoised sets are
free); the budget only caps the swaps. Every set it scores goes through the caller's `score`, so the
search history, the memo and resuming work as for TPE.
"""
from __future__ import annotations

from typing import Callable

from ..engine.skipset import SkipSet
from .candidates import from_slots, searchable_slots

Slot = tuple[str, int]
SHORTLIST = 6          # candidates tried per construction step


def greedy_set(n_layers: int, count: int, matchness: Callable[[SkipSet], float],
               evaluated: Callable[[], int], budget: int, shortlist: int = SHORTLIST
               ) -> tuple[list[Slot], dict[Slot, float]]:
    """The greedy set of exactly `count` sublayers and each sublayer's importance (alone).

    matchness(set) scores a set (the caller memoises); evaluated() counts distinct sets scored so
    far (the budget is in those units). Matchness counts matched tokens, so any gain is at least one.
    """
    slots = searchable_slots(n_layers)
    if not 1 <= count <= len(slots):
        raise ValueError(f"cannot skip {count} of {len(slots)} searchable sublayers")
    alone = {s: matchness(from_slots([s])) for s in slots}
    rank = sorted(slots, key=lambda s: (-alone[s], slots.index(s)))   # least important first

    chosen: list[Slot] = []
    current = 0.0
    for _ in range(count):
        pool = [s for s in rank if s not in chosen][:shortlist]      # in rank order: ties keep the first
        scored = [(matchness(from_slots(chosen + [s])), -k, s) for k, s in enumerate(pool)]
        current, _, best = max(scored)
        chosen.append(best)

    improved = True
    while improved and evaluated() < budget:
        improved = False
        outside = [s for s in rank if s not in chosen][:2 * shortlist]
        for x in reversed(chosen):                   # the last added had the least choice left
            for y in outside:
                if evaluated() >= budget:
                    return chosen, alone
                trial = [y if s == x else s for s in chosen]
                m = matchness(from_slots(trial))
                if m > current:
                    chosen, current, improved = trial, m, True
                    break
            if improved:
                break
    return chosen, alone
