"""Per-domain skip-set search (KNN-SSD's offline stage), scored by matchness and the latency model.

Matchness (SWIFT) is the teacher-forced top-1 agreement between the draft (the model with some
sublayers skipped) and the full model on the full model's own greedy continuation of calibration
prompts. It stands in for the acceptance rate α. Per candidate and sequence it costs one parallel
draft pass over the continuation only: the prompt's keys / values come from the full model, once,
as they do in real self-speculative decoding. With the latency model it gives the objective the
search maximises: predicted tokens per unit time relative to autoregressive decoding (which may
well be < 1 on a CPU; that is reported, not hidden).

Two search modes, side by side (`SEARCH_MODES`):
- "speed": maximise that predicted speedup over sets of any size above a floor (random sampling,
  then TPE - optuna's Bayesian optimiser - over one boolean per sublayer);
- "matchness": KNN-SSD's own recipe: every set skips exactly `skip_ratio` of the sublayers and the
  search maximises matchness (TPE over one score per sublayer; the top-k scores are skipped).
In both, the first and last layers are never skipped: they map tokens into and out of the residual
stream and skipping them wrecks every draft. Matchness values are memoised by set and can be
passed in (`known`), so an interrupted calibration resumes where it stopped.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import zip_longest

import torch
import torch.nn.functional as F

from .backbone import Backbone
from .decode import DecodeConfig
from .generate import generate
from .latency import LatencyModel
from .skipset import SkipSet
from .strategies import Autoregressive

STATIC = "static"
SEARCH_MODES = ("speed", "matchness")


# --- teacher-forcing data ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MatchData:
    """Teacher-forcing data: each prompt + the full model's greedy continuation."""

    sequences: tuple[tuple[int, ...], ...]   # prompt ids + continuation ids
    starts: tuple[int, ...]                  # index in each sequence where the continuation starts
    targets: tuple[torch.Tensor, ...]        # targets[i][j]: full model's argmax for position starts[i]+j
    # the full model's keys / values for positions 0 .. starts[i]-2 of each sequence, (L, kv, P, hd);
    # empty → recomputed on every call (same numbers, slower)
    prefix_kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def __post_init__(self):
        if not len(self.sequences) == len(self.starts) == len(self.targets):
            raise ValueError("MatchData: sequences, starts and targets must have the same length")
        if self.prefix_kv and len(self.prefix_kv) != len(self.sequences):
            raise ValueError("MatchData: prefix_kv must hold one (keys, values) pair per sequence")
        for seq, s, t in zip(self.sequences, self.starts, self.targets):
            if not 1 <= s < len(seq) or len(t) != len(seq) - s:
                raise ValueError("MatchData: each sequence needs a prompt, a continuation and "
                                 "one target per continuation token")

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def tokens(self) -> int:
        """Number of scored positions (continuation tokens)."""
        return sum(len(t) for t in self.targets)

    def rows(self) -> list[tuple]:
        """(sequence, start, targets, prefix_kv or None) per sequence."""
        kv = self.prefix_kv or (None,) * len(self)
        return list(zip(self.sequences, self.starts, self.targets, kv))


def _prefix_kv(backbone: Backbone, seq, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full model's KV for every prompt position but the last (what a real draft reads)."""
    n = start - 1
    cache = backbone.new_cache(max(n, 1))
    if n:
        backbone.forward(seq[:n], cache, SkipSet.empty(), logits="none")
    return cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone()


def _draft_argmax(backbone: Backbone, seq, start: int, skip: SkipSet, kv=None, draft=None) -> torch.Tensor:
    """The draft's argmax for each continuation token seq[start:], in one parallel pass.

    As in real self-speculation the draft attends to the full model's KV of the context (the
    prompt, from `kv`) and to its own KV for the tokens it runs itself. It runs positions
    start-1 .. len-2, whose hidden states predict positions start .. len-1 (the last token is never
    fed). Running the draft over the continuation only, not the whole prompt, makes a candidate
    several times cheaper; and only those rows need the (large) lm_head.
    """
    kv = kv if kv is not None else _prefix_kv(backbone, seq, start)
    n = start - 1
    cache = backbone.new_cache(len(seq) - 1)
    cache.k[:, :, :n], cache.v[:, :, :n] = kv
    cache.length = n
    hidden = backbone.forward(seq[n:-1], cache, skip, logits="none", draft=draft)
    with torch.inference_mode():
        logits = F.linear(hidden, backbone.lm_head) if draft is None else draft.head(hidden)
        return logits.argmax(-1)


def build_match_data(backbone: Backbone, prompts: list[str], continuation_tokens: int = 24,
                     max_prompt_tokens: int = 256, progress: bool = True) -> MatchData:
    """Greedy-continue each prompt with the full model and record its teacher-forced targets."""
    from tqdm.auto import tqdm

    if not prompts:
        raise ValueError("build_match_data needs at least one prompt")
    config = DecodeConfig(max_new_tokens=continuation_tokens)
    sequences, starts, targets, kvs = [], [], [], []
    for text in tqdm(prompts, desc="match data", disable=not progress):
        prompt = backbone.encode(text, max_tokens=max_prompt_tokens)
        cont = generate(backbone, prompt, Autoregressive(), config).token_ids
        seq = tuple(prompt.ids) + tuple(cont)
        kv = _prefix_kv(backbone, seq, len(prompt))
        sequences.append(seq)
        starts.append(len(prompt))
        kvs.append(kv)
        # targets from the very computation the drafts use, so that the empty skip set scores
        # exactly 1.0 (incremental and parallel fp32 passes can differ on near-ties)
        targets.append(_draft_argmax(backbone, seq, len(prompt), SkipSet.empty(), kv))
    return MatchData(tuple(sequences), tuple(starts), tuple(targets), tuple(kvs))


def merge(datas, limit: int | None = None) -> MatchData:
    """Concatenate MatchData, interleaved round-robin so that a `limit` keeps the mix balanced."""
    rows = [row for group in zip_longest(*[d.rows() for d in datas]) for row in group if row is not None]
    if limit is not None:
        rows = rows[:max(1, int(limit))]
    if not rows:
        raise ValueError("merge: no sequences to merge")
    seqs, starts, targets, kvs = zip(*rows)
    # prefix caches are kept only if every part had them (MatchData holds all or none)
    kvs = () if any(kv is None for kv in kvs) else tuple(kvs)
    return MatchData(tuple(seqs), tuple(starts), tuple(targets), kvs)


def _matches(backbone: Backbone, skip: SkipSet, data: MatchData, draft=None) -> int:
    return sum(int((_draft_argmax(backbone, seq, s, skip, kv, draft) == t).sum())
               for seq, s, t, kv in data.rows())


def matchness(backbone: Backbone, skip: SkipSet, data: MatchData, draft=None) -> float:
    """Share of continuation positions where the draft's argmax equals the full model's.

    draft: a draft.DraftWeights to score (quantised weights / small head); None → fp32 weights.
    """
    skip.validate(backbone.n_layers)
    return _matches(backbone, skip, data, draft) / data.tokens


def matchness_per_domain(backbone: Backbone, skip: SkipSet,
                         data_by_domain: dict[str, MatchData], draft=None) -> dict[str, float]:
    """Matchness of one set on every domain (how well a set transfers: the KNN-SSD argument)."""
    return {name: matchness(backbone, skip, data, draft) for name, data in data_by_domain.items()}


# --- search space ------------------------------------------------------------------------------------
def searchable_layers(n_layers: int) -> range:
    """Layers whose sublayers may be skipped: all but the first and the last."""
    if n_layers < 3:
        raise ValueError(f"a model with {n_layers} layers has no skippable middle layers")
    return range(1, n_layers - 1)


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
    return SkipSet(frozenset(i for k, i in chosen if k == "attn"),
                   frozenset(i for k, i in chosen if k == "mlp"), name="initial")


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
    slots = [(kind, i) for i in searchable_layers(n_layers) for kind in ("attn", "mlp")]
    out = []
    for _ in range(n):
        low = min(max(1, min_skipped) / len(slots), 0.5)
        density = rng.uniform(low, max(low, 0.5) if min_skipped <= 1 else min(0.6, low * 1.6))
        chosen = [slot for slot in slots if rng.random() < density] or [rng.choice(slots)]
        out.append(SkipSet(frozenset(i for k, i in chosen if k == "attn"),
                           frozenset(i for k, i in chosen if k == "mlp")))
    return out


def ratio_count(n_layers: int, ratio: float) -> int:
    """Sublayers a set skips at `ratio` of the 2·L sublayers (at least 1, at most all searchable)."""
    if not 0 < ratio < 1:
        raise ValueError(f"skip ratio must be in (0, 1), got {ratio}")
    return min(max(1, round(ratio * 2 * n_layers)), 2 * len(searchable_layers(n_layers)))


def fixed_size_candidates(n_layers: int, count: int, n_random: int, seed: int = 0) -> list[SkipSet]:
    """Starting sets of exactly `count` sublayers: three shaped ones, then uniform random draws."""
    slots = [(kind, i) for i in searchable_layers(n_layers) for kind in ("attn", "mlp")]
    inner = list(searchable_layers(n_layers))
    mid = _middle(n_layers)
    shapes = [None,  # initial_with's order: middle attentions first
              [("attn", i) for i in inner[::-1]] + [("mlp", i) for i in inner[::-1]],   # upper first
              [(k, i) for i in mid for k in ("mlp", "attn")] + slots]                   # middle blocks
    out = [initial_with(n_layers, count)]
    for order in shapes[1:]:
        chosen = list(dict.fromkeys(order))[:count]
        out.append(SkipSet(frozenset(i for k, i in chosen if k == "attn"),
                           frozenset(i for k, i in chosen if k == "mlp")))
    rng = random.Random(seed)
    for _ in range(n_random):
        chosen = rng.sample(slots, count)
        out.append(SkipSet(frozenset(i for k, i in chosen if k == "attn"),
                           frozenset(i for k, i in chosen if k == "mlp")))
    return out


def _params(skip: SkipSet, n_layers: int, count: int | None = None) -> dict:
    if count is not None:     # fixed size: a score per sublayer, the skipped ones score 1
        return {f"{kind}_{i}": float(i in getattr(skip, kind))
                for i in searchable_layers(n_layers) for kind in ("attn", "mlp")}
    return _bool_params(skip, n_layers)


def _bool_params(skip: SkipSet, n_layers: int) -> dict[str, bool]:
    return {f"{kind}_{i}": i in getattr(skip, kind)
            for i in searchable_layers(n_layers) for kind in ("attn", "mlp")}


def _suggest(trial, n_layers: int, name: str, count: int | None = None) -> SkipSet:
    if count is not None:     # fixed size: skip the `count` best-scored sublayers (ties: layer order)
        scores = [(trial.suggest_float(f"{kind}_{i}", 0.0, 1.0), kind, i)
                  for i in searchable_layers(n_layers) for kind in ("attn", "mlp")]
        top = sorted(range(len(scores)), key=lambda j: (-scores[j][0], j))[:count]
        chosen = [scores[j][1:] for j in top]
        return SkipSet(frozenset(i for k, i in chosen if k == "attn"),
                       frozenset(i for k, i in chosen if k == "mlp"), name=name)
    chosen = {"attn": set(), "mlp": set()}
    for i in searchable_layers(n_layers):
        for kind in ("attn", "mlp"):
            if trial.suggest_categorical(f"{kind}_{i}", (False, True)):
                chosen[kind].add(i)
    return SkipSet(frozenset(chosen["attn"]), frozenset(chosen["mlp"]), name=name)


def _check_initial(skip: SkipSet, n_layers: int, min_skipped: int) -> None:
    skip.validate(n_layers)
    edge = {0, n_layers - 1}
    if (skip.attn | skip.mlp) & edge:
        raise ValueError(f"the initial set {skip} skips the first or last layer, which the search "
                         "never does")
    if len(skip) < min_skipped:
        raise ValueError(f"the initial set {skip} skips fewer than min_skipped={min_skipped} "
                         "sublayers (pass min_skipped=0 to allow it)")


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
    import optuna

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

    Trials: the initial set, shaped candidates, `n_random` random sets (default budget // 3), then
    TPE. budget: distinct candidates scored (each costs one matchness pass unless memoised); TPE
    re-proposes sets it likes, and those free repeats do not count (at most 4 × budget trials).
    """
    from tqdm.auto import tqdm

    L = backbone.n_layers
    if mode not in SEARCH_MODES:
        raise ValueError(f"unknown search mode {mode!r}; choose from {', '.join(SEARCH_MODES)}")
    if latency.n_layers != L:
        raise ValueError(f"latency model is for {latency.n_layers} layers, the backbone has {L}")
    if budget < 1:
        raise ValueError("budget must be ≥ 1 candidate")
    n_random = n_random if n_random is not None else max(1, budget // 3)
    count = None
    if mode == "matchness":
        count = ratio_count(L, skip_ratio)
        min_skipped = count
        starts = fixed_size_candidates(L, count, n_random, seed)
        initial = initial if initial is not None else starts[0]
        if len(initial) != count:
            raise ValueError(f"the initial set {initial} does not skip exactly {count} sublayers "
                             f"(skip ratio {skip_ratio})")
    else:
        if initial is None:
            initial = default_initial(L)
            if len(initial) < min_skipped:
                initial = initial_with(L, min_skipped)
        starts = structured_candidates(L) + random_candidates(L, n_random, seed)
    _check_initial(initial, L, min_skipped)
    # the initial set goes first so the result can never be worse than it
    queue = _distinct([initial] + starts, budget, min_skipped)
    scorer = _Scorer(backbone, data, latency, gamma, context_len, min_skipped, draft,
                     draft.kind if draft is not None else "fp32", mode, known, on_new)
    study = _make_study(seed, len(queue))
    for skip in queue:
        study.enqueue_trial(_params(skip, L, count))
    bar = tqdm(total=budget, desc=f"search {name}".rstrip(), disable=not progress)

    def objective(trial) -> float:
        before = scorer.evaluated
        value = scorer(_suggest(trial, L, name, count))
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


def _best(history: list[dict]) -> dict:
    """The best feasible trial (the earliest among equals, so a fixed seed gives one answer)."""
    pool = [k for k, h in enumerate(history) if h["feasible"]] or list(range(len(history)))
    return history[max(pool, key=lambda k: (history[k]["objective"], -k))]


def _result(history: list[dict], name: str) -> SearchResult:
    h = _best(history)
    skip = SkipSet(frozenset(h["attn"]), frozenset(h["mlp"]), name=name)
    return SearchResult(skip=skip, matchness=h["matchness"], objective=h["objective"],
                        initial_objective=history[0]["objective"], trials=len(history),
                        history=tuple(history))


def search_all(backbone: Backbone, data_by_domain: dict[str, MatchData], latency: LatencyModel,
               budget: int = 120, gamma: int = 4, seed: int = 0, progress: bool = True,
               context_len: int = 256, static_per_domain: int | None = 4, min_skipped: int = 1,
               draft=None, mode: str = "speed", skip_ratio: float = 0.25, memo=None
               ) -> tuple[dict[str, SearchResult], SearchResult]:
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
