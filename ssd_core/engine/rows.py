"""The one decode loop: any number of sequences ("rows") advanced together, one step at a time.

`advance(bb, rows)` is one step of every row given: rows still reading their prompt prefill a chunk,
rows that decode draft (in batched draft passes: each row its own skip set and draft weights) and
then one packed pass verifies every row's drafted tokens + 1 beside the prefill chunks
(packed.forward_rows). Acceptance is per row, exactly as for one sequence alone. `decode()` (one
prompt) runs a single row through it; the serving engine (engine.serve) runs many.

Alone, a row's step is what it always was; beside others, `limit` (the goodput rule of
engine.goodput) may shorten every row's draft, down to none (plain batched decoding).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from .backbone import EMPTY, Backbone
from . import events as E             # E._speculative_sample looked up per call (tests swap in wrong rules)
from .events import DecodeConfig, DecodeState, Start, Step, _probs, _sample
from .kv_cache import bytes_per_position
from .lookup import PromptLookup
from .packed import RowPass, forward_rows
from .prompt import PromptIds
from .strategy import Strategy

ALPHA_PRIOR = 0.6      # a row's acceptance before it has drafted (what the goodput rule assumes)
ALPHA_WEIGHT = 0.3     # how fast a row's running acceptance follows its steps


class Row:
    """One sequence's decode state: its cache, tokens, strategy, random stream and progress."""

    def __init__(self, bb: Backbone, prompt: PromptIds, strategy: Strategy | None, config: DecodeConfig,
                 should_stop=None):
        self.bb, self.prompt, self.config = bb, prompt, config
        self.strategy = strategy or Strategy()
        self.should_stop = should_stop
        seed = config.seed if config.seed is not None else int(time.time_ns() % (2 ** 31))
        self.gen = torch.Generator(device=bb.device).manual_seed(seed)
        self.capacity = min(bb.max_positions, len(prompt) + config.max_new_tokens + config.gamma + 2)
        self.cache = None                 # made when the row first runs (engine.serve counts its bytes before)
        self.read = 0                     # prompt tokens already in the cache
        self.t_first = None               # when its first prefill chunk started
        self.tokens: list[int] = []
        self.lookup = None
        self.generated = 0
        self.index = 0
        self.finished = False             # EOS, max tokens or stopped: no more events
        self.stopped = False
        self.draft = None
        self.draft_key = None
        self.alpha = ALPHA_PRIOR          # running acceptance (engine.goodput)
        self.draft_skip = None            # the set it drafts with this step (engine.goodput prices the pass)
        self.n0 = 0                       # cache length before this step's drafts

    @property
    def prefilling(self) -> bool:
        return self.read < len(self.prompt)

    def kv_bytes(self) -> int:
        """What its KV cache takes (allocated whole when the row starts)."""
        return self.capacity * bytes_per_position(self.bb)

    def state(self) -> DecodeState:
        return DecodeState(self.bb, self.cache, self.tokens, self.generated, self.index, self.config)


def advance(bb: Backbone, rows: list[Row], chunk: int | None = None, limit=None, pool=None
            ) -> list[tuple[Row, object]]:
    """One step of every row in `rows`: [(row, Start | Step)], at most one event per row.

    chunk: most prompt tokens prefilled in this step, over all rows (None: whole prompts).
    limit: a callable (decoding rows, their γ, whether they look up) → (γ cap, words), consulted only
    when several rows decode together (engine.goodput.GoodputRule.choose).
    pool: a kv_cache.KVPool that new rows take their cache from (a slot, when one is free and long enough)."""
    t_start = time.perf_counter()
    events = []
    decoding = []
    for r in rows:
        if r.finished:
            continue
        if r.should_stop is not None and r.should_stop():     # Stop: also while the prompt is still read
            r.finished = r.stopped = True
            continue
        if not r.prefilling:
            decoding.append(r)
    plans = [_plan(r) for r in decoding]
    words = ""
    if limit is not None and len(decoding) > 1:
        cap, words = limit(decoding, [p[1] for p in plans], [bool(p[2]) for p in plans])
        plans = [(d, min(g, cap), p[:cap] if cap else ()) for d, g, p in plans]
    # drafts: model drafts in batched passes, one per draft weights (rows that share them pass together)
    t_draft = time.perf_counter()
    drafts = _draft(bb, decoding, plans)
    t_verify = time.perf_counter()
    passes = []
    for r, (drafted, _, _) in zip(decoding, drafts):
        r.cache.crop(r.n0)
        passes.append(RowPass([r.tokens[-1]] + drafted, r.cache, EMPTY, "all"))
    budget = chunk if chunk is not None and len(rows) > 1 else None
    reading = []
    for r in rows:
        if r.finished or not r.prefilling or (budget is not None and budget <= 0):
            continue
        if r.cache is None:
            r.cache = (pool.take(r.capacity) if pool is not None else None) or r.bb.new_cache(r.capacity)
            r.t_first = t_verify
        take = len(r.prompt) - r.read if budget is None else min(budget, len(r.prompt) - r.read)
        budget = None if budget is None else budget - take
        passes.append(RowPass(list(r.prompt.ids[r.read:r.read + take]), r.cache, EMPTY, "none"))
        r.read += take
        reading.append(r)
    outs = forward_rows(bb, passes) if passes else []
    bb.sync()                          # CUDA: the pass has run before the clock is read
    t_accept = time.perf_counter()
    n = len(decoding)
    for r, plan, drafted, logits in zip(decoding, plans, drafts, outs[:n]):
        events.append((r, _accept(r, plan, drafted, logits, len(rows), words,
                                   (t_start, t_draft, t_verify, t_accept))))
    for r, hidden in zip(reading, outs[n:]):
        if not r.prefilling:
            events.append((r, _started(r, hidden)))
    return events


def _plan(r: Row):
    """(decision, γ, lookup proposal) for a decoding row's next step: today's single-sequence choice."""
    cfg = r.config
    r.n0 = r.cache.length
    decision = r.strategy.choose(r.state())
    r.draft_skip = decision.skip
    room = cfg.max_new_tokens - r.generated
    gamma = 0
    if decision.skip is not None:
        gamma = (cfg.gamma if r.strategy.length is None else
                 r.strategy.length.gamma(decision.skip, r.cache.length, cfg.gamma))
        gamma = max(0, min(gamma, room - 1))
    # a lookup draft costs nothing to make: propose as many as the config allows
    proposal = r.lookup.propose(min(cfg.gamma, room - 1)) if r.lookup is not None and gamma else ()
    if decision.skip is not None and decision.skip.channel_key != r.draft_key:
        r.draft = r.bb.drafts.get(cfg.draft, cfg.small_head, decision.skip)
        r.draft_key = decision.skip.channel_key
    return decision, gamma, proposal


def _draft(bb: Backbone, rows: list[Row], plans) -> list[tuple[list[int], list[float], list]]:
    """Every row's draft: (tokens, the draft's probability of each, sampling rows q). Lookup proposals as
    they are; model drafts one position per pass for all rows still drafting, grouped by draft weights."""
    out = [([], [], []) for _ in rows]
    live = []
    for j, (r, (decision, gamma, proposal)) in enumerate(zip(rows, plans)):
        if proposal:      # a deterministic draft: q is one-hot, so speculative sampling accepts with prob. p(d)
            out[j][0].extend(proposal)
            out[j][1].extend([1.0] * len(proposal))
            if not r.config.greedy:
                out[j][2].extend(F.one_hot(torch.tensor(d, device=bb.device), bb.vocab).float() for d in proposal)
        elif gamma and decision.skip is not None:
            live.append(j)
    for k in range(max((plans[j][1] for j in live), default=0)):
        live = [j for j in live if plans[j][1] > k]
        groups: dict[int, list[int]] = {}
        for j in live:
            groups.setdefault(id(rows[j].draft), []).append(j)
        stopped = set()
        for members in groups.values():
            passes = [RowPass([out[j][0][-1] if out[j][0] else rows[j].tokens[-1]], rows[j].cache,
                              plans[j][0].skip, "last") for j in members]
            for j, logits in zip(members, forward_rows(bb, passes, draft=rows[members[0]].draft)):
                if not _take_draft(rows[j], logits, out[j]):
                    stopped.add(j)
        live = [j for j in live if j not in stopped]
    return out


def _take_draft(r: Row, logits, out) -> bool:
    """Choose the row's next draft token from its draft logits; False when the threshold stops it."""
    cfg = r.config
    if cfg.greedy:
        p_top, d = torch.softmax(logits, -1).max(-1)
        p_top, d = float(p_top), int(d)
        if p_top < cfg.threshold:
            return False
        out[1].append(p_top)
    else:
        q = _probs(logits, cfg)
        if float(q.max()) < cfg.threshold:
            return False
        d = _sample(q, r.gen)
        out[2].append(q)
        out[1].append(float(q[d]))
    out[0].append(d)
    return True


def _accept(r: Row, plan, draft, logits, rows: int, words: str, clock) -> Step:
    """The verifier's verdict on one row's draft; commits, updates the row and returns its Step."""
    drafted, draft_probs, q_rows = draft
    decision, proposal = plan[0], plan[2]
    t_start, t_draft, t_verify, t_accept = clock
    cfg, bb, n = r.config, r.bb, r.n0
    if cfg.greedy:
        top = logits.argmax(-1)       # on the logits, as transformers does: ties resolve the same way
        p_top = (logits.gather(-1, top[:, None])[:, 0].float() - torch.logsumexp(logits.float(), -1)).exp()
        verified, verify_probs = tuple(top.tolist()), tuple(p_top.tolist())
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == verified[accepted]:
            accepted += 1
        committed = tuple(drafted[:accepted]) + (verified[accepted],)
    else:
        p_rows = _probs(logits, cfg)
        accepted, bonus = E._speculative_sample(logits, drafted, q_rows, cfg, r.gen, p_rows=p_rows)
        committed = tuple(drafted[:accepted]) + (bonus,)
        verified = committed
        verify_probs = tuple(float(p_rows[i, t]) for i, t in enumerate(committed))
    r.cache.crop(n + accepted + 1)
    t_end = time.perf_counter()
    draft_s, verify_s = t_verify - t_draft, t_accept - t_verify
    if drafted:
        r.alpha += ALPHA_WEIGHT * (accepted / len(drafted) - r.alpha)
    source = ("lookup" if proposal else "model") if drafted else ""
    step = Step(index=r.index, context_len=n, drafted=tuple(drafted), draft_probs=tuple(draft_probs),
                verified=verified, accepted=accepted, committed=committed, skip=decision.skip,
                draft_s=draft_s, verify_s=verify_s,
                overhead_s=max(0.0, (t_end - t_start) - draft_s - verify_s), note=decision.note,
                source=source, forecast=decision.forecast, verify_probs=verify_probs, rows=rows, rule=words)
    return _commit(r, step)


def _commit(r: Row, step: Step) -> Step:
    committed, finished = step.committed, False
    if r.config.stop_at_eos:
        for j, t in enumerate(committed):
            if t in r.bb.eos_ids:
                committed, finished = committed[:j + 1], True
                break
    r.tokens.extend(committed)
    if r.lookup is not None:
        r.lookup.extend(committed)
    r.generated += len(committed)
    finished = finished or r.generated >= r.config.max_new_tokens
    if committed != step.committed or finished:
        step = replace(step, committed=committed, finished=finished)
    if r.strategy.length is not None:
        r.strategy.length.update(step)
    r.strategy.update(step)
    r.index += 1
    r.finished = finished
    return step


def _started(r: Row, hidden) -> Start:
    """The prompt is read: first token, the strategy's plan, the draft weights; the row's Start."""
    bb, cfg = r.bb, r.config
    logits = bb.head_logits(hidden[-1:])[0]
    first = int(logits.argmax()) if cfg.greedy else _sample(_probs(logits, cfg), r.gen)
    prefill_s = time.perf_counter() - r.t_first
    plan = r.strategy.start(bb, r.prompt, hidden[-1])
    # a set that keeps part of each MLP drafts with weights of its own: built (once) before the clock
    r.draft = bb.drafts.get(cfg.draft, cfg.small_head, plan.skip)
    r.draft_key = plan.skip.channel_key if plan.skip is not None else None
    r.tokens = list(r.prompt.ids) + [first]
    r.lookup = PromptLookup(r.tokens) if cfg.lookup else None
    r.generated = 1
    r.finished = (cfg.stop_at_eos and first in bb.eos_ids) or r.generated >= cfg.max_new_tokens
    return Start(len(r.prompt), first, hidden[-1], prefill_s, r.strategy.name, r.prompt.truncated,
                 draft=r.draft.label if r.draft is not None else "fp32 draft", skip=plan.skip,
                 domain=plan.domain, route=plan.route, forecast=plan.forecast)
