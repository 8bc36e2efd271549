"""Decode loops as generators of small immutable events.

`decode(...)` yields one `Start` event (after prefill and the strategy's routing),
then one `Step` per verification step. Autoregressive steps are Steps with no
drafts. The app, the benchmark and the tests all consume these same events.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch
import torch.nn.functional as F

from .backbone import EMPTY, Backbone
from .draft import DEFAULT_DRAFT_KIND, DRAFT_KINDS
from .lookup import PromptLookup
from .prompt import PromptIds
from .skipset import SkipSet
from .strategy import Decision, Forecast, Route, Strategy


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


# --- the loop -----------------------------------------------------------------------------------
def encode_for(backbone: Backbone, prompt: str, config: DecodeConfig) -> PromptIds:
    """The prompt as `decode` runs it: tokenised, shortened to leave room in the context for the answer."""
    room = backbone.max_positions - config.max_new_tokens - config.gamma - 2
    if room < 72:
        raise ValueError(f"max_new_tokens={config.max_new_tokens} leaves no room for a prompt in "
                         f"the model's {backbone.max_positions}-token context")
    return backbone.encode(prompt, max_tokens=min(config.max_prompt_tokens or room, room))


def decode(backbone: Backbone, prompt: PromptIds | str, strategy: Strategy | None = None,
           config: DecodeConfig = DecodeConfig(), should_stop=None, lookahead: int | None = None,
           report_wait: bool = False) -> Iterator[Start | Step]:
    """Prefill, then speculative (or autoregressive) steps until EOS or max_new_tokens.

    should_stop: optional callable polled once per step (cancellation).
    With a serving engine attached to the backbone (engine.serve.Engine.attach) the request joins its
    running batch: the engine steps it beside every other visitor's. lookahead: most events the engine
    may step ahead of this consumer (0: only when asked for the next one, as a race's lockstep laps
    need; None: free). report_wait: also yield `Waiting` events while it waits for KV memory.
    Alone (no engine, or on the engine's own thread) it runs here, through the same step code.
    """
    strategy = strategy or Strategy()
    if isinstance(prompt, str):
        prompt = encode_for(backbone, prompt, config)
    from .rows import Row, advance             # rows builds on this module's types
    row = Row(backbone, prompt, strategy, config, should_stop)
    engine = getattr(backbone, "engine", None)
    if engine is not None and engine.serving():
        yield from engine.submit(row, lookahead=lookahead, report_wait=report_wait)
        return
    while not row.finished:
        for _, event in advance(backbone, [row]):
            yield event


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
