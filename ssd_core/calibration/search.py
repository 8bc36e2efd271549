"""Per-domain skip-set search (KNN-SSD's offline stage), scored by matchness and the latency model.

Matchness (calibration.matchness) stands in for the acceptance rate; with the latency model it gives
the objective the search maximises: predicted tokens per unit time relative to autoregressive
decoding (which may well be < 1 on a CPU; that is reported, not hidden).

Two search modes, side by side (`SEARCH_MODES`):
- "speed": maximise that predicted speedup over sets of any size above a floor (random sampling,
  then TPE - optuna's Bayesian optimiser - over one boolean per sublayer);
- "matchness": KNN-SSD's own recipe: every set skips exactly `skip_ratio` of the sublayers and the
  search maximises matchness, greedily (calibration.greedy: score each sublayer alone, build the set
  step by step, then swap). TPE over one score per sublayer was tried there too and matched worse
  on every held-out domain (README history), so matchness mode has only the greedy method.
In both modes, the first and last layers are never skipped (calibration.candidates). Matchness values are
memoised by set and can be passed in (`known`), so an interrupted calibration resumes where it stopped.
"""
from __future__ import annotations

from dataclasses import dataclass

from tqdm.auto import tqdm

from ..engine.backbone import Backbone
from ..engine.skipset import SkipSet
from .candidates import (check_initial, default_initial, initial_with, random_candidates, ratio_count,
                         searchable_slots, structured_candidates, suggest_set, trial_params)
from .greedy import SHORTLIST, greedy_set
from .latency import LatencyModel
from .matchness import MatchData, matchness, merge

STATIC = "static"
SEARCH_MODES = ("speed", "matchness")
# calibrate's modes: these two, and "channels" (no search: per-domain MLP channel rankings, channels.py)
CALIBRATION_MODES = (*SEARCH_MODES, "channels")


# --- the search ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SearchResult:
    skip: SkipSet            # named after the domain (or "static")
    matchness: float         # on the data it was searched on
    objective: float         # predicted speedup at that matchness (latency.expected_speedup)
    initial_objective: float
    trials: int
    history: tuple[dict, ...]  # per trial: {"attn", "mlp", "matchness", "objective", "feasible"}

    def to_dict(self) -> dict:
        return {"skip": self.skip.to_dict(), "matchness": self.matchness,
                "objective": self.objective, "initial_objective": self.initial_objective,
                "trials": self.trials, "history": [dict(h) for h in self.history]}


def set_key(skip: SkipSet) -> str:
    """A set's key in a matchness memo (stable text, so it survives a JSON round trip)."""
    return "a" + ",".join(map(str, sorted(skip.attn))) + "|m" + ",".join(map(str, sorted(skip.mlp)))


class _Scorer:
    """Objective of a candidate, memoised: TPE re-proposes sets and a forward pass is the cost.

    known: set_key → matchness already measured on this data (a resumed search); new values are
    added to it and handed to `on_new(key, value)`.
    """

    def __init__(self, backbone, data, latency, gamma, context_len, min_skipped, draft=None, kind="fp32",
                 mode="speed", known=None, on_new=None):
        self.backbone, self.data, self.latency = backbone, data, latency
        self.gamma, self.context_len, self.min_skipped = gamma, context_len, min_skipped
        self.draft, self.kind, self.mode = draft, kind, mode
        self.known = known if known is not None else {}
        self.on_new = on_new
        self.seen: set[str] = set()
        self.history: list[dict] = []

    def __call__(self, skip: SkipSet) -> float:
        key = set_key(skip)
        if key not in self.known:
            self.known[key] = matchness(self.backbone, skip, self.data, self.draft)
            if self.on_new is not None:
                self.on_new(key, self.known[key])
        self.seen.add(key)
        m = self.known[key]
        g = self.latency.best_gamma(skip, m, self.gamma, self.context_len, self.kind)
        speed = self.latency.expected_speedup(skip, m, g, self.context_len, self.kind)
        o = m if self.mode == "matchness" else speed
        feasible = len(skip) >= self.min_skipped
        self.history.append({"attn": sorted(skip.attn), "mlp": sorted(skip.mlp), "matchness": m,
                             "objective": o, "speedup": speed, "feasible": feasible})
        # a draft skipping (almost) nothing is the full model run twice: it can only lose, yet its
        # perfect matchness would win whenever skipping is not worth it, so TPE is told it is bad
        return o if feasible else 0.0

    @property
    def evaluated(self) -> int:
        """Distinct sets scored in this search (memoised ones included)."""
        return len(self.seen)


def _make_study(seed: int, n_startup: int):
    import optuna     # lazy: ~1 s to import, and only a speed-mode search needs it

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(1, n_startup))
    return optuna.create_study(direction="maximize", sampler=sampler)


def _distinct(candidates: list[SkipSet], budget: int, min_skipped: int) -> list[SkipSet]:
    seen, out = set(), []
    for skip in candidates:
        key = (skip.attn, skip.mlp)
        if key not in seen and len(skip) >= min_skipped and len(out) < budget:
            seen.add(key)
            out.append(skip)
    return out


def search_skip_set(backbone: Backbone, data: MatchData, latency: LatencyModel, budget: int = 120,
                    gamma: int = 4, context_len: int = 256, seed: int = 0, name: str = "",
                    initial: SkipSet | None = None, n_random: int | None = None,
                    progress: bool = True, min_skipped: int = 1, draft=None,
                    mode: str = "speed", skip_ratio: float = 0.25,
                    known: dict | None = None, on_new=None) -> SearchResult:
    """Find the skip set maximising the mode's objective on `data`.

    mode "speed": predicted speedup (latency model, at the best draft length ≤ gamma) over sets of
    at least `min_skipped` sublayers; "matchness": matchness over sets of exactly
    ratio_count(L, skip_ratio) sublayers (KNN-SSD). draft: the draft.DraftWeights the sets will draft
    with; None → the fp32 weights. known / on_new: a matchness memo to resume from (see _Scorer).

    Speed mode's trials: the initial set, shaped candidates, `n_random` random sets (default
    budget // 3), then TPE. budget: distinct candidates scored (each costs one matchness pass unless
    memoised); TPE re-proposes sets it likes, and those free repeats do not count (at most 4 × budget
    trials). Matchness mode: calibration.greedy.greedy_set; its construction always completes, the
    budget caps only its swaps.
    """
    L = backbone.n_layers
    if mode not in SEARCH_MODES:
        raise ValueError(f"unknown search mode {mode!r}; choose from {', '.join(SEARCH_MODES)}")
    if latency.n_layers != L:
        raise ValueError(f"latency model is for {latency.n_layers} layers, the backbone has {L}")
    if budget < 1:
        raise ValueError("budget must be ≥ 1 candidate")
    kind = draft.kind if draft is not None else "fp32"
    if mode == "matchness":
        count = ratio_count(L, skip_ratio)
        if initial is not None:
            raise ValueError("matchness mode builds its sets greedily from single sublayers: it takes no "
                             "initial set")
        scorer = _Scorer(backbone, data, latency, gamma, context_len, count, draft, kind, mode, known, on_new)
        return _greedy(scorer, L, count, budget, name, progress)
    n_random = n_random if n_random is not None else max(1, budget // 3)
    if initial is None:
        initial = default_initial(L)
        if len(initial) < min_skipped:
            initial = initial_with(L, min_skipped)
    starts = structured_candidates(L) + random_candidates(L, n_random, seed)
    check_initial(initial, L, min_skipped)
    scorer = _Scorer(backbone, data, latency, gamma, context_len, min_skipped, draft, kind, mode, known, on_new)
    # the initial set goes first so the result can never be worse than it
    queue = _distinct([initial] + starts, budget, min_skipped)
    study = _make_study(seed, len(queue))
    for skip in queue:
        study.enqueue_trial(trial_params(skip, L))
    bar = tqdm(total=budget, desc=f"search {name}".rstrip(), disable=not progress)

    def objective(trial) -> float:
        before = scorer.evaluated
        value = scorer(suggest_set(trial, L, name))
        bar.update(scorer.evaluated - before)
        bar.set_postfix(best=f"{_best(scorer.history)['objective']:.3f}")
        return value

    def enough(study, trial) -> None:
        if scorer.evaluated >= budget:
            study.stop()

    try:
        study.optimize(objective, n_trials=4 * budget, callbacks=[enough])
    finally:
        bar.close()
    return _result(scorer.history, name)


def _greedy(scorer: _Scorer, L: int, count: int, budget: int, name: str, progress: bool) -> SearchResult:
    least = len(searchable_slots(L)) + (count - 1) * SHORTLIST    # the construction's passes at most
    bar = tqdm(total=max(budget, least), desc=f"greedy {name}".rstrip(), disable=not progress)

    def score(skip: SkipSet) -> float:
        before = scorer.evaluated
        scorer(skip)
        bar.update(scorer.evaluated - before)
        return scorer.known[set_key(skip)]

    try:
        greedy_set(L, count, score, lambda: scorer.evaluated, budget)
    finally:
        bar.close()
    return _result(scorer.history, name)


def _best(history: list[dict]) -> dict:
    """The best feasible trial (the earliest among equals, so a fixed seed gives one answer)."""
    pool = [k for k, h in enumerate(history) if h["feasible"]] or list(range(len(history)))
    return history[max(pool, key=lambda k: (history[k]["objective"], -k))]


def _result(history: list[dict], name: str) -> SearchResult:
    h = _best(history)
    skip = SkipSet(frozenset(h["attn"]), frozenset(h["mlp"]), name=name)
    first = next((t for t in history if t["feasible"]), history[0])   # greedy starts with single sublayers
    return SearchResult(skip=skip, matchness=h["matchness"], objective=h["objective"],
                        initial_objective=first["objective"], trials=len(history),
                        history=tuple(history))


def static_share(prompts_per_domain: int, n_domains: int, least: int = 4) -> int:
    """Sequences each domain gives the static mix: at least `least`, and enough that the static set
    is searched on no fewer sequences than one domain's set (a smaller mix would handicap it)."""
    return max(least, -(-prompts_per_domain // n_domains))


def search_all(backbone: Backbone, data_by_domain: dict[str, MatchData], latency: LatencyModel,
               budget: int = 120, gamma: int = 4, seed: int = 0, progress: bool = True,
               context_len: int = 256, static_per_domain: int | None = 4, min_skipped: int = 1,
               draft=None, mode: str = "speed", skip_ratio: float = 0.25,
               memo=None) -> tuple[dict[str, SearchResult], SearchResult]:
    """One set per domain, plus the global static ("Self-SD mix") set searched on all domains.

    static_per_domain: sequences each domain contributes to the static mix (None: all of them).
    A full mix would make the static search cost as much as all domain searches together.
    memo: a SearchMemo (or None): matchness already measured per search, kept as the search goes.
    """
    if STATIC in data_by_domain:
        raise ValueError(f"{STATIC!r} is reserved for the global set; rename that domain")
    kw = dict(budget=budget, gamma=gamma, context_len=context_len, seed=seed, progress=progress,
              min_skipped=min_skipped, draft=draft, mode=mode, skip_ratio=skip_ratio)
    limit = None if static_per_domain is None else static_per_domain * len(data_by_domain)
    jobs = [*data_by_domain.items(), (STATIC, merge(list(data_by_domain.values()), limit))]
    out = {}
    for name, data in jobs:
        known, on_new = (None, None) if memo is None else (memo.values(name), memo.recorder(name))
        out[name] = search_skip_set(backbone, data, latency, name=name, known=known, on_new=on_new, **kw)
    static = out.pop(STATIC)
    return out, static
