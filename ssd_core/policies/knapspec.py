"""KnapSpec: choose sublayers to skip with a knapsack under the latency model.

Each sublayer is an item. Its weight is the time skipping it saves (from the
latency model at the current context length: attention grows with context, MLPs
do not); its loss is 1 − cos(h, h + Δ), how much it changes the hidden state
over recent tokens. A 0/1 knapsack DP gives, for every amount of time saved, the
least total loss; an acceptance model α = exp(−κ·loss) turns each point of that
front into expected tokens per unit time, and the best point wins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..calibration.latency import LatencyModel
from ..engine.backbone import EMPTY
from ..engine.skipset import SkipSet
from ..engine.strategy import Decision, Forecast, Plan, Strategy

DEFAULT_KAPPA = 8.0


# --- importance ------------------------------------------------------------------------------------
def sublayer_similarity(backbone, cache, tokens: list[int], window: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Mean cos(h, h+Δ) of every attention and MLP sublayer over the last `window` cached tokens.

    The tokens are re-run through the full model over the live cache, which leaves the
    cache as it was (the same KV is recomputed for the same positions).
    """
    n = cache.length
    w = max(1, min(window, n - 1))
    cache.crop(n - w)
    collect: list = []
    backbone.forward(tokens[n - w:n], cache, EMPTY, logits="none", collect=collect)
    attn = np.ones(backbone.n_layers)
    mlp = np.ones(backbone.n_layers)
    for layer, kind, before, after in collect:
        cos = float(torch.nn.functional.cosine_similarity(before, after, dim=-1).mean())
        (attn if kind == "attn" else mlp)[layer] = cos
    return attn, mlp


def prompt_similarity(backbone, prompt_ids, window: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """The same measure over a prompt's last tokens (for calibration), with a scratch cache."""
    ids = list(prompt_ids)
    cache = backbone.new_cache(len(ids) + 1)
    backbone.forward(ids[:-1] or ids, cache, EMPTY, logits="none")
    return sublayer_similarity(backbone, cache, ids if len(ids) > 1 else ids + ids, window)


# --- the knapsack ---------------------------------------------------------------------------------
def knapsack_min_loss(weights: list[int], losses: list[float], capacity: int):
    """0/1 knapsack: for each exact total weight c ≤ capacity, the least loss and its items.

    Returns (best, choose) where best[c] is the minimal loss of a subset weighing exactly c
    (inf if none) and choose(c) → sorted item indices of that subset.
    """
    n = len(weights)
    best = np.full(capacity + 1, math.inf)
    best[0] = 0.0
    take = np.zeros((n, capacity + 1), dtype=bool)
    for i, (w, loss) in enumerate(zip(weights, losses)):
        if w > capacity:
            continue
        cand = np.full(capacity + 1, math.inf)
        cand[w:] = best[:capacity + 1 - w] + loss
        better = cand < best
        take[i] = better
        best = np.where(better, cand, best)

    def choose(c: int) -> list[int]:
        items = []
        for i in range(n - 1, -1, -1):
            if take[i, c]:
                items.append(i)
                c -= weights[i]
        return sorted(items)
    return best, choose


@dataclass(frozen=True)
class KnapChoice:
    skip: SkipSet
    predicted_speedup: float
    acceptance: float
    loss: float
    context_len: int

    @property
    def forecast(self) -> Forecast:
        return Forecast(self.skip, self.acceptance, self.predicted_speedup, self.context_len)


def choose_skip(latency: LatencyModel, attn_sim, mlp_sim, context_len: int, gamma: int,
                kappa: float = DEFAULT_KAPPA, protect=None, bins: int = 240,
                max_ratio: float = 0.75, kind: str = "fp32", agreement: float = 1.0) -> KnapChoice:
    """The skip set that maximises predicted tokens per unit time at this context length.

    kind: the draft weights (their sublayer costs); agreement: the bare draft's acceptance (< 1
    for a quantised draft), which multiplies exp(−κ·loss). Skipping nothing is a candidate too.
    """
    L = latency.n_layers
    protect = {0, L - 1} if protect is None else set(protect)
    full = latency.step_time(EMPTY, context_len, kind)
    unit = full / bins
    items = [("attn", i) for i in range(L) if i not in protect] + \
            [("mlp", i) for i in range(L) if i not in protect]
    attn_save, mlp_save = latency.sublayer_times(context_len, kind)
    saves = [attn_save if k == "attn" else mlp_save for k, _ in items]
    weights = [max(1, round(s / unit)) for s in saves]
    losses = [max(0.0, 1.0 - float((attn_sim if k == "attn" else mlp_sim)[i])) for k, i in items]
    capacity = min(sum(weights), int(bins * max_ratio))
    best, choose = knapsack_min_loss(weights, losses, capacity)
    top = None
    for c in range(0, capacity + 1):
        if not math.isfinite(best[c]):
            continue
        chosen = [items[j] for j in choose(c)] if c else []
        skip = SkipSet(frozenset(i for k, i in chosen if k == "attn"),
                       frozenset(i for k, i in chosen if k == "mlp"), name="knapspec")
        acc = agreement * math.exp(-kappa * best[c])
        speed = latency.expected_speedup(skip, acc, gamma, context_len, kind)
        if top is None or speed > top.predicted_speedup:
            top = KnapChoice(skip, speed, acc, float(best[c]), context_len)
    return top


def fit_kappa(points: list[tuple[float, float]]) -> float:
    """κ of α = exp(−κ·loss), least squares through the origin on (loss, matchness) points."""
    xs = [l for l, m in points if l > 0 and 0 < m <= 1]
    ys = [-math.log(m) for l, m in points if l > 0 and 0 < m <= 1]
    den = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys)) / den if den else DEFAULT_KAPPA


# --- the strategy -----------------------------------------------------------------------------------
class KnapSpec(Strategy):
    """Re-optimises its skip set every `every` steps as the context grows.

    Each re-optimisation's prediction travels on that step's event (`Step.forecast`).
    """

    name = "knapspec"

    def __init__(self, latency: LatencyModel, gamma: int, kappa: float = DEFAULT_KAPPA,
                 every: int = 32, window: int = 8, kind: str = "fp32", agreement: float = 1.0):
        self.latency, self.gamma, self.kappa = latency, gamma, kappa
        self.kind, self.agreement = kind, agreement
        self.every, self.window = every, window
        self.current: KnapChoice | None = None

    def start(self, backbone, prompt, embedding) -> Plan:
        if self.latency.n_layers != backbone.n_layers:
            raise ValueError("latency model was profiled on a model with another layer count")
        return Plan()               # the first set is chosen from the live context at the first step

    def choose(self, state) -> Decision:
        if self.current is None or state.steps % self.every == 0:
            attn, mlp = sublayer_similarity(state.backbone, state.cache, state.tokens, self.window)
            ctx = state.cache.length
            choice = choose_skip(self.latency, attn, mlp, ctx, self.gamma, self.kappa, kind=self.kind,
                                 agreement=self.agreement)
            changed = self.current is None or choice.skip != self.current.skip
            self.current = choice
            note = (f"knapspec: re-optimised at context {ctx}: skip {len(choice.skip.attn)} attn + "
                    f"{len(choice.skip.mlp)} mlp, predicted {choice.predicted_speedup:.2f}×"
                    + ("" if changed else " (unchanged)"))
            return Decision(choice.skip, note=note, forecast=choice.forecast)
        return Decision(self.current.skip)
