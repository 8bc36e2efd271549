"""Convenience wrappers: whole-text generation with stats, and a text-increment stream."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator

from .backbone import Backbone
from .decode import DecodeConfig, Start, Step, decode
from .strategy import Strategy


@dataclass(frozen=True)
class Stats:
    """The field's figures for one generation: τ, α and tokens/s as speculative decoding defines them."""

    new_tokens: int
    steps: int                 # verification steps (autoregressive steps count as one each)
    tau: float                 # tokens committed per step, bonus token included
    alpha: float               # accepted drafts / drafted (0 when nothing was drafted)
    drafted: int
    accepted: int
    wall_s: float
    tokens_per_s: float
    prefill_s: float
    draft_s: float
    verify_s: float
    overhead_s: float
    accept_lengths: tuple[int, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["accept_lengths"] = list(self.accept_lengths)
        return d


def summarize(start: Start | None, steps: Iterable[Step], wall_s: float) -> Stats:
    """Stats from the events of one run; the prefill's first token counts as a new token."""
    steps = list(steps)
    committed = sum(len(s.committed) for s in steps)
    new_tokens = committed + (1 if start is not None else 0)
    drafted = sum(len(s.drafted) for s in steps)
    accepted = sum(s.accepted for s in steps)
    return Stats(
        new_tokens=new_tokens, steps=len(steps),
        tau=committed / len(steps) if steps else 1.0,
        alpha=accepted / drafted if drafted else 0.0,
        drafted=drafted, accepted=accepted, wall_s=wall_s,
        tokens_per_s=new_tokens / wall_s if wall_s > 0 else 0.0,
        prefill_s=start.prefill_s if start else 0.0,
        draft_s=sum(s.draft_s for s in steps), verify_s=sum(s.verify_s for s in steps),
        overhead_s=sum(s.overhead_s for s in steps),
        accept_lengths=tuple(len(s.committed) for s in steps),
    )


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: tuple[int, ...]
    start: Start
    steps: tuple[Step, ...]
    stats: Stats


def generate(backbone: Backbone, prompt, strategy: Strategy | None = None,
             config: DecodeConfig = DecodeConfig(), **overrides) -> Generation:
    """Generate a whole answer; returns text, ids, every event and the stats."""
    if overrides:
        config = replace(config, **overrides)
    t0 = time.perf_counter()
    start, steps = None, []
    for event in decode(backbone, prompt, strategy, config):
        if isinstance(event, Start):
            start = event
        else:
            steps.append(event)
    wall = time.perf_counter() - t0
    ids = (start.first_token,) + tuple(t for s in steps for t in s.committed)
    return Generation(backbone.decode(ids), ids, start, tuple(steps), summarize(start, steps, wall))


def stream_text(backbone: Backbone, prompt, strategy: Strategy | None = None,
                config: DecodeConfig = DecodeConfig(), should_stop=None) -> Iterator[str]:
    """Yield text increments as tokens are committed (safe across multi-byte characters)."""
    ids: list[int] = []
    shown = ""
    for event in decode(backbone, prompt, strategy, config, should_stop=should_stop):
        ids.extend([event.first_token] if isinstance(event, Start) else event.committed)
        text = backbone.decode(ids)
        if text.endswith("\ufffd"):       # half a UTF-8 character: wait for the rest
            continue
        if text.startswith(shown):
            delta, shown = text[len(shown):], text
        else:                              # the tokenizer re-merged earlier text
            delta, shown = text, text
        if delta:
            yield delta
