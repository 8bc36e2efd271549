"""Latency model, profiled on the machine it runs on (KnapSpec's cost side).

One single-token forward with skip set S at context length C is modelled as
    t(S, C) = overhead + head + (L − |S.attn|)·(a + b·C) + (L − |S.mlp|)·m
and a verification pass over k tokens as v(k) × t(∅, C). Everything the search,
KnapSpec, the `auto` policy and the app's cost panel say about speed comes from here.
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .backbone import EMPTY, Backbone
from .decode import Decision, Strategy
from .skipset import SkipSet


def expected_tokens(acceptance: float, gamma: int) -> float:
    """E[tokens per step] with i.i.d. acceptance α and γ drafts: (1 − α^(γ+1)) / (1 − α)."""
    a = min(max(float(acceptance), 0.0), 1.0)
    if a >= 1.0:
        return gamma + 1.0
    return (1.0 - a ** (gamma + 1)) / (1.0 - a)


@dataclass(frozen=True)
class LatencyModel:
    n_layers: int
    attn_a: float                 # s per attention sublayer at context 0
    attn_b: float                 # s per attention sublayer per context token
    mlp: float                    # s per MLP sublayer
    head: float                   # s for the lm_head
    overhead: float               # s per forward outside sublayers and lm_head (Python, norms, embed)
    verify: dict[int, float]      # k tokens → verify time / single-token full step time
    measured: list[dict] = field(default_factory=list)   # raw points, for the fit report
    machine: dict = field(default_factory=dict)

    # --- costs -------------------------------------------------------------------------------
    def attn_time(self, context_len: int) -> float:
        return self.attn_a + self.attn_b * context_len

    def step_time(self, skip: SkipSet = EMPTY, context_len: int = 256) -> float:
        L = self.n_layers
        return (self.overhead + self.head + (L - len(skip.attn)) * self.attn_time(context_len)
                + (L - len(skip.mlp)) * self.mlp)

    def draft_cost(self, skip: SkipSet, context_len: int = 256) -> float:
        """c: one draft step relative to one full step."""
        return self.step_time(skip, context_len) / self.step_time(EMPTY, context_len)

    def verify_cost(self, k: int) -> float:
        """v: a verification pass over k tokens relative to one full step (interpolated)."""
        keys = sorted(self.verify)
        if k in self.verify:
            return self.verify[k]
        if k <= keys[0]:
            return self.verify[keys[0]]
        if k >= keys[-1]:                       # extrapolate with the last slope
            k1, k2 = keys[-2], keys[-1]
            slope = (self.verify[k2] - self.verify[k1]) / (k2 - k1)
            return self.verify[k2] + slope * (k - k2)
        lo = max(x for x in keys if x < k)
        hi = min(x for x in keys if x > k)
        w = (k - lo) / (hi - lo)
        return self.verify[lo] * (1 - w) + self.verify[hi] * w

    def expected_speedup(self, skip: SkipSet, acceptance: float, gamma: int,
                         context_len: int = 256) -> float:
        """E[tokens per step] / (γ·c + v(γ+1)): tokens per unit time vs autoregressive."""
        c = self.draft_cost(skip, context_len)
        return expected_tokens(acceptance, gamma) / (gamma * c + self.verify_cost(gamma + 1))

    def breakdown(self, skip: SkipSet, acceptance: float, gamma: int, context_len: int = 256) -> dict:
        """Every number of the cost panel, in one place."""
        c = self.draft_cost(skip, context_len)
        v = self.verify_cost(gamma + 1)
        e = expected_tokens(acceptance, gamma)
        return {"draft_cost": c, "verify_cost": v, "expected_tokens": e,
                "step_cost": gamma * c + v, "predicted_speedup": e / (gamma * c + v),
                "full_step_ms": 1000 * self.step_time(EMPTY, context_len),
                "draft_step_ms": 1000 * self.step_time(skip, context_len),
                "attn_ms": 1000 * self.attn_time(context_len), "mlp_ms": 1000 * self.mlp,
                "head_ms": 1000 * self.head, "overhead_ms": 1000 * self.overhead,
                "acceptance": acceptance, "gamma": gamma, "context_len": context_len}

    def break_even_acceptance(self, skip: SkipSet, gamma: int, context_len: int = 256) -> float | None:
        """Smallest acceptance at which speculation stops losing (None if it never does)."""
        lo, hi = 0.0, 1.0
        if self.expected_speedup(skip, 1.0, gamma, context_len) < 1.0:
            return None
        for _ in range(40):
            mid = (lo + hi) / 2
            if self.expected_speedup(skip, mid, gamma, context_len) < 1.0:
                lo = mid
            else:
                hi = mid
        return hi

    # --- persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["verify"] = {str(k): v for k, v in self.verify.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyModel":
        d = dict(d)
        d["verify"] = {int(k): float(v) for k, v in d["verify"].items()}
        return cls(**d)


# --- profiling --------------------------------------------------------------------------------------
def _time_forward(bb: Backbone, cache, n_tokens: int, context: int, skip: SkipSet, repeats: int) -> float:
    ids = [1] * n_tokens
    times = []
    for _ in range(repeats):
        cache.length = context
        t = time.perf_counter()
        bb.forward(ids, cache, skip, logits="all" if n_tokens > 1 else "last")
        times.append(time.perf_counter() - t)
    cache.length = 0
    # the minimum: timing noise on a shared CPU only ever adds time
    return min(times)


def _fit_line(xs, ys) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


def profile(bb: Backbone, contexts=(64, 512, 1024, 2048), verify_ks=(1, 2, 3, 4, 5, 7, 9),
            repeats: int = 9, progress: bool = True) -> LatencyModel:
    """Measure sublayer, lm_head, overhead and verify costs with real forwards on this machine."""
    from tqdm.auto import tqdm

    L = bb.n_layers
    contexts = [c for c in contexts if c + max(verify_ks) + 2 <= bb.max_positions]
    cache = bb.new_cache(max(contexts) + max(verify_ks) + 2)
    all_attn = SkipSet(frozenset(range(L)), frozenset())
    all_mlp = SkipSet(frozenset(), frozenset(range(L)))
    nothing = SkipSet(frozenset(range(L)), frozenset(range(L)))
    jobs = [(c, s) for c in contexts for s in (EMPTY, all_attn, all_mlp, nothing)]
    bar = tqdm(total=len(jobs) + len(verify_ks) + 1, desc="latency profile", disable=not progress)
    cache.k.fill_(0.0), cache.v.fill_(0.0)                          # fault in every page now
    for c in contexts:                                              # warm-up
        _time_forward(bb, cache, 1, c, EMPTY, 2)
    raw, points = {}, []
    for c, s in jobs:
        raw[(c, s)] = _time_forward(bb, cache, 1, c, s, repeats)
        bar.update()
    for c in contexts:
        full = raw[(c, EMPTY)]
        points.append({"context": c, "full_ms": 1000 * full,
                       "attn_ms": 1000 * (full - raw[(c, all_attn)]) / L,
                       "mlp_ms": 1000 * (full - raw[(c, all_mlp)]) / L,
                       "bare_ms": 1000 * raw[(c, nothing)]})
    a, b = _fit_line([p["context"] for p in points], [p["attn_ms"] / 1000 for p in points])
    mlp = max(1e-6, statistics.median(p["mlp_ms"] for p in points) / 1000)
    bare = statistics.median(p["bare_ms"] for p in points) / 1000
    x = torch.zeros(1, bb.hidden, dtype=bb.dtype)
    head_times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.nn.functional.linear(x, bb.lm_head)
        head_times.append(time.perf_counter() - t)
    head = min(head_times)
    bar.update()
    ref = contexts[min(1, len(contexts) - 1)]
    one = _time_forward(bb, cache, 1, ref, EMPTY, repeats)
    verify = {}
    for k in verify_ks:
        verify[k] = round(_time_forward(bb, cache, k, ref, EMPTY, repeats) / one, 4) if k > 1 else 1.0
        bar.update()
    bar.close()
    # verifying more tokens never costs less; on a busy CPU single timings can say otherwise
    running = 1.0
    for k in sorted(verify):
        running = verify[k] = max(verify[k], running)
    machine = {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "verify_context": ref}
    return LatencyModel(n_layers=L, attn_a=max(a, 1e-6), attn_b=max(b, 0.0), mlp=mlp, head=head,
                        overhead=max(bare - head, 0.0), verify=verify, measured=points, machine=machine)


def fit_report(model: LatencyModel) -> list[dict]:
    """Predicted vs measured full-step time at every profiled context (the fit, for the README)."""
    out = []
    for p in model.measured:
        pred = 1000 * model.step_time(EMPTY, p["context"])
        out.append({"context": p["context"], "measured_ms": round(p["full_ms"], 2),
                    "predicted_ms": round(pred, 2), "error_pct": round(100 * (pred / p["full_ms"] - 1), 1)})
    return out


# --- the auto policy ------------------------------------------------------------------------------
class Auto(Strategy):
    """Wraps a strategy; decodes autoregressively when the latency model predicts a loss."""

    def __init__(self, inner: Strategy, latency: LatencyModel, acceptance: dict[str, float],
                 gamma: int, default_acceptance: float = 0.5):
        self.inner, self.latency, self.acceptance = inner, latency, acceptance
        self.gamma, self.default_acceptance = gamma, default_acceptance
        self.name = "auto"
        self.fallback_note = ""

    def start(self, backbone, prompt, embedding) -> dict:
        info = dict(self.inner.start(backbone, prompt, embedding))
        probe = self.inner.choose(_Probe(len(prompt)))
        skip = probe.skip
        if skip is None:
            info["auto"] = {"speculate": False, "reason": "inner strategy is autoregressive"}
            self.fallback_note = "auto: autoregressive"
            return info
        acc = self.acceptance.get(skip.name, self.default_acceptance)
        pred = self.latency.expected_speedup(skip, acc, self.gamma, len(prompt))
        speculate = pred >= 1.0
        self.fallback_note = "" if speculate else (
            f"auto: predicted {pred:.2f}× < 1 at acceptance {acc:.2f} → autoregressive")
        info["auto"] = {"speculate": speculate, "predicted_speedup": pred, "acceptance": acc,
                        "skip": skip.name}
        return info

    def choose(self, state) -> Decision:
        if self.fallback_note:
            return Decision(None, note=self.fallback_note)
        return self.inner.choose(state)

    def update(self, step) -> None:
        self.inner.update(step)


@dataclass
class _Probe:
    """A stand-in DecodeState for asking a strategy its first choice before decoding starts."""

    context_len: int
    generated: int = 0
    steps: int = 0
    tokens: list = field(default_factory=list)
    backbone: object = None
    cache: object = None
    config: object = None
