"""How much to speculate when several visitors share a step: the goodput rule.

Alone, a verification pass over γ + 1 tokens costs little more than one token's step, so drafting
pays. In a batch the packed verify pass carries rows × (γ + 1) tokens and is no longer nearly free
(SmartSpec's observation; vLLM turns speculation down under load). Each shared step the rule picks
one draft length γ ≤ every row's own for all rows — 0 is plain batched decoding — to maximise

    goodput(γ) = Σ_rows E[tokens | α_row, min(γ, γ_row)]  ÷  (γ · draft pass(B) + verify pass(B, γ + 1))

with E[tokens | α, γ] = 1 + α + … + α^γ, α_row each row's running acceptance (rows.Row.alpha) and
the two pass costs from `BatchCosts`: packed passes measured on the machine that runs (rows × tokens
per row), quietly and cached, like the single-sequence latency model (calibration.profiles).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch

from .machine import _read, cache_dir, cpu_info
from .packed import RowPass, forward_rows
from .skipset import SkipSet

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16)
TOKENS = (1, 2, 3, 5)
CONTEXT = 128                  # the context the passes are timed at (a classroom prompt and answer)
COSTS_FILE = "batch_costs.json"
METHOD = 1                     # bump when the measurement changes: cached tables are measured again


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens one step commits on average: 1 + α + … + α^γ (acceptance i.i.d. per position)."""
    return sum(alpha ** i for i in range(gamma + 1))


def _interp(xs, ys, x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past either end."""
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class BatchCosts:
    """Seconds of packed passes on this machine: the verifier over rows × tokens, the int8 draft over rows."""

    full: dict[int, dict[int, float]]       # rows → tokens per row → s
    draft: dict[int, float]                 # rows → s (one int8 draft token per row, no sublayer skipped)
    cpu: dict = field(default_factory=dict)
    measured: str = ""
    provisional: bool = False               # the built-in shape, not yet measured here

    def full_s(self, rows: float, tokens: float) -> float:
        rs = sorted(self.full)
        by_rows = [_interp(sorted(self.full[r]), [self.full[r][t] for t in sorted(self.full[r])], tokens) for r in rs]
        return max(1e-6, _interp(rs, by_rows, rows))

    def draft_s(self, rows: float) -> float:
        rs = sorted(self.draft)
        return max(1e-6, _interp(rs, [self.draft[r] for r in rs], rows)) if rows > 0 else 0.0

    def to_dict(self) -> dict:
        return {"full": {str(r): {str(t): s for t, s in by.items()} for r, by in self.full.items()},
                "draft": {str(r): s for r, s in self.draft.items()}, "cpu": self.cpu, "measured": self.measured,
                "provisional": self.provisional}

    @classmethod
    def from_dict(cls, d: dict) -> "BatchCosts":
        return cls(full={int(r): {int(t): float(s) for t, s in by.items()} for r, by in d["full"].items()},
                   draft={int(r): float(s) for r, s in d["draft"].items()}, cpu=d.get("cpu", {}),
                   measured=d.get("measured", ""), provisional=bool(d.get("provisional", False)))

    @classmethod
    def builtin(cls) -> "BatchCosts":
        """Until this machine's are measured: SmolLM2-135M on a 2-core AMD EPYC (AVX-512), ms."""
        ms = {1: (28.8, 33.0, 32.0, 34.0), 2: (33.0, 35.1, 36.2, 39.8), 4: (35.1, 40.5, 43.9, 59.3),
              8: (49.4, 57.1, 70.4, 96.5), 16: (69.8, 108.6, 129.0, 184.8)}
        draft = {1: 13.3, 2: 17.0, 4: 20.9, 8: 30.8, 16: 46.7}
        return cls(full={r: {t: v / 1000 for t, v in zip(TOKENS, row)} for r, row in ms.items()},
                   draft={r: v / 1000 for r, v in draft.items()}, provisional=True)


@dataclass(frozen=True)
class Choice:
    gamma: int                  # the cap for this step (0: plain batched decoding)
    rows: int
    goodput: dict               # γ → predicted committed tokens / s over all rows
    words: str


class GoodputRule:
    """Per shared step, the draft length that maximises predicted goodput (module docstring)."""

    def __init__(self, backbone, costs: BatchCosts | None = None):
        self.bb = backbone
        self.costs = costs or BatchCosts.builtin()
        self.last: Choice | None = None

    def predict(self, alphas, gammas, lookups, ratios) -> dict[int, float]:
        """γ → predicted tokens/s for rows with these acceptances, own γ caps, lookup flags and draft
        weight ratios (a draft pass of a skip set reads that share of the weights)."""
        B = len(alphas)
        out = {}
        for g in range(0, max(gammas, default=0) + 1):
            lengths = [min(g, gr) for gr in gammas]
            tokens = sum(expected_tokens(a, n) for a, n in zip(alphas, lengths))
            drafting = [r for n, look, r in zip(lengths, lookups, ratios) if n and not look]
            draft = g * self.costs.draft_s(len(drafting)) * (statistics.mean(drafting) if drafting else 0.0)
            out[g] = tokens / (draft + self.costs.full_s(B, 1 + statistics.mean(lengths)))
        return out

    def choose(self, rows, gammas, lookups) -> tuple[int, str]:
        """(γ cap, what it chose and why in words) for these decoding rows (rows.advance's `limit`)."""
        ratios = [1.0 - self.bb.skip_weight_ratio(r.draft_skip) if r.draft_skip is not None else 1.0 for r in rows]
        alphas = [r.alpha for r in rows]
        pred = self.predict(alphas, gammas, lookups, ratios)
        g = max(pred, key=lambda k: (pred[k], -k))
        words = (f"{len(rows)} rows shared this step: draft length {g}" + (" (plain batched decoding)" if g == 0 else "")
                 + f" — predicted {pred[g]:.0f} tokens/s for all rows" +
                 (f" vs {pred[0]:.0f} plain" if g else (f" vs {max(v for k, v in pred.items() if k):.0f} drafting"
                                                        if len(pred) > 1 else "")) +
                 f" (mean α {statistics.mean(alphas):.2f}{', provisional costs' if self.costs.provisional else ''})")
        self.last = Choice(g, len(rows), pred, words)
        return g, words

    def curve(self, alpha: float, gamma: int, ratio: float, rows=range(1, 17), lookup: bool = False) -> list[dict]:
        """Predicted speedup over plain batched decoding at each number of rows, all rows at this α:
        {"rows", "gamma" (the best), "speedup", "tokens_per_s"} (the "Why (not) faster?" panel)."""
        out = []
        for b in rows:
            pred = self.predict([alpha] * b, [gamma] * b, [lookup] * b, [ratio] * b)
            g = max(pred, key=lambda k: (pred[k], -k))
            out.append({"rows": b, "gamma": g, "speedup": pred[g] / pred[0], "tokens_per_s": pred[g],
                        "fixed_gamma_speedup": pred[gamma] / pred[0]})
        return out


# --- measuring this machine's costs ------------------------------------------------------------------
def _key(bb) -> str:
    shape = (bb.n_layers, bb.hidden, bb.vocab, str(bb.dtype), bb.kernel)
    return hashlib.sha256(json.dumps([cpu_info(), torch.__version__, shape, METHOD]).encode()).hexdigest()[:16]


def measure_costs(bb, repeats: int = 3, turn=None) -> BatchCosts:
    """Time packed passes (ROWS × TOKENS for the verifier, ROWS for the int8 draft) at CONTEXT; each timing
    inside `turn()` (profiles.Quiet.slice: only while no visitor's model job runs)."""
    turn = turn or nullcontext
    draft = bb.drafts.get("int8", False, SkipSet.empty())
    caches = [bb.new_cache(CONTEXT + max(TOKENS) + 1) for _ in range(max(ROWS))]
    for c in caches:
        c.k.fill_(0.0), c.v.fill_(0.0)                 # fault every page in before the clock

    def timed(rows, tokens, weights=None) -> float:
        ts = []
        for i in range(repeats + 1):                   # the first warms this shape up and is dropped
            with turn():
                for c in caches[:rows]:
                    c.length = CONTEXT
                t = time.perf_counter()
                forward_rows(bb, [RowPass(list(range(1, tokens + 1)), c, SkipSet.empty(),
                                          "all" if tokens > 1 else "last") for c in caches[:rows]], draft=weights)
                bb.sync()
                if i:
                    ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    full = {r: {t: timed(r, t) for t in TOKENS} for r in ROWS}
    drafts = {r: timed(r, 1, draft) for r in ROWS}
    return BatchCosts(full, drafts, cpu=cpu_info(), measured=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def costs_for_machine(bb, turn=None, refresh: bool = False) -> BatchCosts:
    """This machine's BatchCosts: cached (cache_dir()/batch_costs.json, keyed by CPU, threads, torch, model
    shape and kernel), or measured now and cached."""
    path, key = cache_dir() / COSTS_FILE, _key(bb)
    entry = _read(path).get(key)
    if not refresh and isinstance(entry, dict):
        try:
            return BatchCosts.from_dict(entry)
        except (KeyError, TypeError, ValueError):
            pass
    t = time.perf_counter()
    costs = measure_costs(bb, turn=turn)
    log.info("batched pass costs measured in %.1f s", time.perf_counter() - t)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = costs.to_dict()
        tmp = path.with_name(f"{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not cache batched pass costs in %s: %s", path, exc)
    return costs
