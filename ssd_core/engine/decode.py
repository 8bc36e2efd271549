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

    @property
    def speculative(self) -> bool:
        return self.skip is not None

    @property
    def rejected(self) -> tuple[int, ...]:
        """Draft tokens the verifier threw away."""
        return self.drafted[self.accepted:]


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
           config: DecodeConfig = DecodeConfig(), should_stop=None) -> Iterator[Start | Step]:
    """Prefill, then speculative (or autoregressive) steps until EOS or max_new_tokens.

    should_stop: optional callable polled once per step (cancellation).
    """
    strategy = strategy or Strategy()
    if isinstance(prompt, str):
        prompt = encode_for(backbone, prompt, config)
    gen = torch.Generator(device=backbone.device).manual_seed(config.seed if config.seed is not None else
                                        int(time.time_ns() % (2 ** 31)))
    budget = config.max_new_tokens
    cache = backbone.new_cache(min(backbone.max_positions, len(prompt) + budget + config.gamma + 2))
    t0 = time.perf_counter()
    pre = backbone.prefill(prompt, cache)
    first = int(pre.logits.argmax()) if config.greedy else _sample(_probs(pre.logits, config), gen)
    prefill_s = time.perf_counter() - t0
    plan = strategy.start(backbone, prompt, pre.embedding)
    # a set that keeps part of each MLP drafts with weights of its own: built (once) before the clock
    draft = backbone.drafts.get(config.draft, config.small_head, plan.skip)
    draft_key = plan.skip.channel_key if plan.skip is not None else None
    yield Start(len(prompt), first, pre.embedding, prefill_s, strategy.name, prompt.truncated,
                draft=draft.label if draft is not None else "fp32 draft", skip=plan.skip,
                domain=plan.domain, route=plan.route, forecast=plan.forecast)
    tokens = list(prompt.ids) + [first]
    lookup = PromptLookup(tokens) if config.lookup else None
    generated = 1
    finished = config.stop_at_eos and first in backbone.eos_ids
    index = 0
    while not finished and generated < budget:
        if should_stop is not None and should_stop():
            return
        t_start = time.perf_counter()
        state = DecodeState(backbone, cache, tokens, generated, index, config)
        decision = strategy.choose(state)
        room = budget - generated          # tokens we may still commit
        gamma = 0                          # autoregressive step
        if decision.skip is not None:
            gamma = (config.gamma if strategy.length is None else
                     strategy.length.gamma(decision.skip, cache.length, config.gamma))
            gamma = max(0, min(gamma, room - 1))
        # a lookup draft costs nothing to make: propose as many as the config allows
        proposal = lookup.propose(min(config.gamma, room - 1)) if lookup is not None and gamma else ()
        if decision.skip is not None and decision.skip.channel_key != draft_key:
            draft = backbone.drafts.get(config.draft, config.small_head, decision.skip)
            draft_key = decision.skip.channel_key
        step = _step(backbone, cache, tokens[-1], decision, config, gen, gamma, proposal,
                     draft, index, t_start)
        committed = step.committed
        if config.stop_at_eos:
            for j, t in enumerate(committed):
                if t in backbone.eos_ids:
                    committed = committed[:j + 1]
                    finished = True
                    break
        tokens.extend(committed)
        if lookup is not None:
            lookup.extend(committed)
        generated += len(committed)
        finished = finished or generated >= budget
        if committed != step.committed or finished:
            step = replace(step, committed=committed, finished=finished)
        if strategy.length is not None:
            strategy.length.update(step)
        strategy.update(step)
        index += 1
        yield step


def _step(bb: Backbone, cache, pending: int, decision: Decision, cfg: DecodeConfig,
          gen: torch.Generator, gamma: int, proposal: tuple[int, ...], draft, index: int,
          t_start: float) -> Step:
    """Draft (lookup proposal, or up to gamma model drafts), verify with the full model, accept."""
    n = cache.length
    greedy = cfg.greedy
    skip = decision.skip
    drafted: list[int] = []
    draft_probs: list[float] = []
    q_rows = []
    t_draft = time.perf_counter()
    if proposal:
        # a deterministic draft: q is one-hot, so speculative sampling accepts with probability p(d)
        drafted = list(proposal)
        draft_probs = [1.0] * len(drafted)
        if not greedy:
            q_rows = [F.one_hot(torch.tensor(d, device=bb.device), bb.vocab).float() for d in drafted]
    x = pending
    for _ in range(0 if proposal else gamma):
        logits = bb.forward([x], cache, skip, draft=draft)
        if greedy:
            p_top, d = torch.softmax(logits, -1).max(-1)
            p_top, d = float(p_top), int(d)
            if p_top < cfg.threshold:
                break
            draft_probs.append(p_top)
        else:
            q = _probs(logits, cfg)
            if float(q.max()) < cfg.threshold:
                break
            d = _sample(q, gen)
            q_rows.append(q)
            draft_probs.append(float(q[d]))
        drafted.append(d)
        x = d
    t_verify = time.perf_counter()
    cache.crop(n)
    logits = bb.forward([pending] + drafted, cache, EMPTY, logits="all")
    bb.sync()                         # CUDA: the verify pass has run before the clock is read
    t_accept = time.perf_counter()
    if greedy:
        top = logits.argmax(-1)       # on the logits, as transformers does: ties resolve the same way
        p_top = (logits.gather(-1, top[:, None])[:, 0].float() - torch.logsumexp(logits.float(), -1)).exp()
        verified, verify_probs = tuple(top.tolist()), tuple(p_top.tolist())
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == verified[accepted]:
            accepted += 1
        committed = tuple(drafted[:accepted]) + (verified[accepted],)
    else:
        p_rows = _probs(logits, cfg)
        accepted, bonus = _speculative_sample(logits, drafted, q_rows, cfg, gen, p_rows=p_rows)
        committed = tuple(drafted[:accepted]) + (bonus,)
        verified = committed
        verify_probs = tuple(float(p_rows[i, t]) for i, t in enumerate(committed))
    cache.crop(n + accepted + 1)
    t_end = time.perf_counter()
    draft_s, verify_s = t_verify - t_draft, t_accept - t_verify
    source = ("lookup" if proposal else "model") if drafted else ""
    return Step(index=index, context_len=n, drafted=tuple(drafted), draft_probs=tuple(draft_probs),
                verified=verified, accepted=accepted, committed=committed, skip=skip,
                draft_s=draft_s, verify_s=verify_s,
                overhead_s=max(0.0, (t_end - t_start) - draft_s - verify_s), note=decision.note,
                source=source, forecast=decision.forecast, verify_probs=verify_probs)


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
