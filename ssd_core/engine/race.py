"""Two decodes of one prompt, timed fairly: laps in lockstep, warmed, decode phase only.

Run one after the other, the first lap of a race measured 0.56–0.94× the second with the *same* draft:
it met the machine in another state (the page still rendering the first lap's stream, background
start-up work, first calls at new pass shapes). Here the two decodes advance step by step — whichever
has committed fewer tokens goes next, so they alternate through the same seconds and any load falls
on both — and each lap's first step is left out of its clock (its first calls warm both). The speed
of a lap is its decode phase: committed tokens after the first step ÷ the seconds spent producing
them (prefill and routing are the same work in both laps and not what a race compares).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator

from .decode import DecodeConfig, Start, Step, decode

WARM_STEPS = 1          # steps of each lap left out of its clock


@dataclass
class Lap:
    """One side of a race: its events and the seconds spent producing each step."""

    start: Start | None = None
    start_s: float = 0.0                  # prefill and routing: what producing the Start event took
    steps: list[Step] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    done: bool = False

    @property
    def token_ids(self) -> tuple[int, ...]:
        first = (self.start.first_token,) if self.start is not None else ()
        return first + tuple(t for s in self.steps for t in s.committed)

    @property
    def committed(self) -> int:
        return (1 if self.start is not None else 0) + sum(len(s.committed) for s in self.steps)

    def timed(self, skip: int = WARM_STEPS) -> tuple[int, float]:
        """(tokens, seconds) of the decode phase after the first `skip` steps (all steps if too few)."""
        skip = skip if len(self.steps) > skip else 0
        return (sum(len(s.committed) for s in self.steps[skip:]), sum(self.step_s[skip:]))

    @property
    def tokens_per_s(self) -> float:
        n, t = self.timed()
        return n / t if t > 0 else 0.0

    def segments(self, parts: int = 3) -> list[tuple[int, float]]:
        """(tokens, seconds) of the timed steps cut into `parts` runs of consecutive steps."""
        skip = WARM_STEPS if len(self.steps) > WARM_STEPS else 0
        steps, secs = self.steps[skip:], self.step_s[skip:]
        n = len(steps)
        cuts = [round(i * n / parts) for i in range(parts + 1)]
        return [(sum(len(s.committed) for s in steps[a:b]), sum(secs[a:b])) for a, b in zip(cuts, cuts[1:]) if b > a]


def lockstep(backbone, prompt, a, b, config: DecodeConfig = DecodeConfig(), should_stop=None
             ) -> Iterator[tuple[str, Start | Step, Lap]]:
    """Decode `prompt` with strategies `a` and `b` in lockstep; yields ("a" | "b", event, that lap).

    Both prefill first (a, then b), then whichever lap has committed fewer tokens takes the next step
    (on a tie, the one that did not step last), until both are done or `should_stop()`."""
    laps = {"a": Lap(), "b": Lap()}
    # through a serving engine, each lap steps only when asked (lookahead 0): the laps still alternate
    # and the second lap joins the batch as soon as the first runs (group: its reader waits on both)
    pair = object()
    runs = {"a": decode(backbone, prompt, a, config, should_stop=should_stop, lookahead=0, group=pair),
            "b": decode(backbone, prompt, b, config, should_stop=should_stop, lookahead=0, group=pair)}
    last = "b"
    order = ["a", "b"]                      # prefill: a, then b
    while True:
        live = [k for k in ("a", "b") if not laps[k].done]
        if not live:
            return
        if order:
            side = order.pop(0)
        else:
            side = min(live, key=lambda k: (laps[k].committed, k == last))
        t = time.perf_counter()
        try:
            ev = next(runs[side])
        except StopIteration:
            laps[side].done = True
            continue
        dt = time.perf_counter() - t
        lap = laps[side]
        if isinstance(ev, Start):
            lap.start, lap.start_s = ev, dt
        else:
            lap.steps.append(ev)
            lap.step_s.append(dt)
            last = side
        yield side, ev, lap


def segment_ratios(a: Lap, b: Lap, parts: int = 3) -> list[float]:
    """The same ratio over each third of the laps: a spread that says how steady the measurement was."""
    out = []
    for (na, sa), (nb, sb) in zip(a.segments(parts), b.segments(parts)):
        if na and nb and sa > 0 and sb > 0:
            out.append((na / sa) / (nb / sb))
    return out


def measured_costs(spec: Lap | list, plain: Lap | list) -> dict:
    """This run's own c and v, from times alone (no latency model): c = median seconds of one model
    draft pass ÷ median plain step, lookup steps excluded; v = median verification pass ÷ median plain
    step, at the verified length seen most. `plain`: the steps of a plain (autoregressive) lap."""
    spec_steps = spec.steps if isinstance(spec, Lap) else list(spec)
    plain_steps = plain.steps if isinstance(plain, Lap) else list(plain)
    plain_s = [s.verify_s for s in plain_steps if not s.speculative]
    if not plain_s:
        return {}
    full = statistics.median(plain_s)
    model = [s.draft_s / len(s.drafted) for s in spec_steps if s.source == "model" and s.drafted]
    by_k: dict[int, list[float]] = {}
    for s in spec_steps:
        if s.speculative:
            by_k.setdefault(len(s.drafted) + 1, []).append(s.verify_s)
    out = {"full_ms": 1000 * full}
    if model:
        out["c"] = statistics.median(model) / full
    if by_k:
        k = max(by_k, key=lambda x: (len(by_k[x]), x))
        out["v"], out["v_tokens"] = statistics.median(by_k[k]) / full, k
    return out
