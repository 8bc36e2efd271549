"""The decode loop's vocabulary: its settings, its events and the token-choice rules.

`DecodeConfig` (what a request asks), `Start` / `Step` / `Waiting` (what a decode yields),
`DecodeState` (what a strategy may look at) and the sampling helpers shared by the one loop
(engine.rows) and its callers. engine.decode re-exports them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backbone import Backbone
from .draft import DEFAULT_DRAFT_KIND, DRAFT_KINDS
from .skipset import SkipSet
from .strategy import Forecast, Route


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    gamma: int = 4                 # most draft tokens per step
    threshold: float = 0.0         # stop drafting when the draft's top-1 probability falls below this
    temperature: float = 0.0       # 0 → greedy
    top_p: float = 1.0
    seed: int | None = 0
    stop_at_eos: bool = True
    max_prompt_tokens: int | None = None
    draft: str = DEFAULT_DRAFT_KIND  # draft weights: "int8" (quantised copy) or "fp32" (see draft.py)
    small_head: bool = True        # draft with the calibration's frequent-token head, when there is one
    lookup: bool = True            # try a prompt-lookup draft before running the model draft

    def __post_init__(self):
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens must be ≥ 1"),
            (isinstance(self.gamma, int) and 1 <= self.gamma <= 64, "gamma (draft length) must be 1..64"),
            (_finite(self.threshold) and 0.0 <= self.threshold <= 1.0, "threshold must be in [0, 1]"),
            (_finite(self.temperature) and 0.0 <= self.temperature <= 10.0, "temperature must be in [0, 10]"),
            (_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.draft in DRAFT_KINDS, f"draft must be one of {', '.join(DRAFT_KINDS)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass(frozen=True)
class Start:
    """Emitted once, after prefill: the prompt, its first token and the strategy's plan."""

    prompt_len: int
    first_token: int
    embedding: torch.Tensor
    prefill_s: float
    strategy: str
    truncated: bool = False
    draft: str = ""                    # the draft's weights in words, e.g. "int8 draft, 8k-token head"
    skip: SkipSet | None = None        # the first set the strategy will draft with, if it knows it yet
    domain: str | None = None          # the domain it drafts for (knn: routed; oracle: given)
    route: Route | None = None         # knn: the router's answer (votes, neighbours, similarity)
    forecast: Forecast | None = None   # auto: the latency model's prediction it starts from


@dataclass(frozen=True)
class Step:
    """One verification step (or one autoregressive step, with no drafts)."""

    index: int
    context_len: int                  # tokens in the cache before this step (prompt + committed)
    drafted: tuple[int, ...]          # draft tokens proposed
    draft_probs: tuple[float, ...]    # the draft's probability of each proposed token
    verified: tuple[int, ...]         # verifier's token per position (greedy: len(drafted)+1)
    accepted: int                     # drafts accepted
    committed: tuple[int, ...]        # tokens added to the output this step
    skip: SkipSet | None              # the set drafted with; None = autoregressive step
    draft_s: float
    verify_s: float
    overhead_s: float
    note: str = ""
    finished: bool = False
    source: str = ""                  # who drafted: "model", "lookup" (prompt lookup) or "" (none)
    forecast: Forecast | None = None  # the strategy's prediction when it (re)chose its set this step
    verify_probs: tuple[float, ...] = ()  # the verifier's probability of its token at each position
    rows: int = 1                     # sequences that shared this step's passes (1: alone)
    rule: str = ""                    # what the goodput rule chose for the shared step, and why (engine.goodput)

    @property
    def speculative(self) -> bool:
        return self.skip is not None

    @property
    def rejected(self) -> tuple[int, ...]:
        """Draft tokens the verifier threw away."""
        return self.drafted[self.accepted:]


@dataclass(frozen=True)
class Waiting:
    """Emitted (when asked for) while a request waits for room in the serving engine's KV memory."""

    position: int                      # requests ahead of it, plus one
    reason: str = ""


@dataclass
class DecodeState:
    """What a strategy may look at when choosing: the live decode context."""

    backbone: Backbone
    cache: object
    tokens: list[int]      # prompt + committed tokens, the last one not yet in the cache
    generated: int
    steps: int
    config: DecodeConfig


# --- token choice ---------------------------------------------------------------------------------
def _probs(logits: torch.Tensor, cfg: DecodeConfig) -> torch.Tensor:
    """Sampling distribution after temperature and top-p (rows = positions)."""
    p = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(p, dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < cfg.top_p   # always keeps the top token
        sorted_p = sorted_p * keep
        p = torch.zeros_like(p).scatter_(-1, order, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def _sample(p: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(p, 1, generator=gen))


def _speculative_sample(logits, drafted, q_rows, cfg, gen, p_rows=None) -> tuple[int, int]:
    """Accept draft i with prob min(1, p/q); on rejection resample from norm(max(0, p − q)).
    p_rows: the verifier's distributions (_probs of logits), when the caller has them already."""
    p_rows = _probs(logits, cfg) if p_rows is None else p_rows
    for i, d in enumerate(drafted):
        p, q = p_rows[i], q_rows[i]
        ratio = float(p[d]) / max(float(q[d]), 1e-20)
        u = float(torch.rand((), generator=gen, device=gen.device))
        if u < min(1.0, ratio):
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        if total <= 1e-12:            # p ≈ q: the residual is empty, fall back to p
            return i, _sample(p, gen)
        return i, _sample(residual / total, gen)
    return len(drafted), _sample(p_rows[len(drafted)], gen)
