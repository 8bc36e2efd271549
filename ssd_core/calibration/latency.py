"""Latency model, profiled on the machine and device it runs on (KnapSpec's cost side).

One single-token forward with skip set S at context length C is modelled as
    t(S, C) = overhead + head + (L − |S.attn|)·(a + b·C) + (L − |S.mlp|)·m
and a verification pass over k tokens as v(k) × t(∅, C). Everything the search,
KnapSpec, the `auto` policy and the app's cost panel say about speed comes from here.
"""
from __future__ import annotations

import contextlib
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from ..engine.backbone import EMPTY, Backbone
from ..engine.device import device_label, same_device
from ..engine.machine import cpu_info, cpu_words, same_cpu
from ..engine.skipset import SkipSet


def expected_tokens(acceptance: float, gamma: int) -> float:
    """E[tokens per step] with i.i.d. acceptance α and γ drafts: (1 − α^(γ+1)) / (1 − α)."""
    a = min(max(float(acceptance), 0.0), 1.0)
    if a >= 1.0:
        return gamma + 1.0
    return (1.0 - a ** (gamma + 1)) / (1.0 - a)


def speedup(acceptance: float, draft_cost: float, verify_cost: float, gamma: int) -> float:
    """E[tokens per step] / (γ·c + v): tokens per unit time vs autoregressive decoding.

    c: one draft step, v: one verification pass over γ + 1 tokens, both in full steps.
    """
    return expected_tokens(acceptance, gamma) / (gamma * draft_cost + verify_cost)


def break_even(draft_cost: float, verify_cost: float, gamma: int) -> float | None:
    """Smallest acceptance at which speculation stops losing (None if even α = 1 loses)."""
    lo, hi = 0.0, 1.0
    if speedup(1.0, draft_cost, verify_cost, gamma) < 1.0:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        if speedup(mid, draft_cost, verify_cost, gamma) < 1.0:
            lo = mid
        else:
            hi = mid
    return hi


def acceptance_for_tau(tau: float, gamma: int) -> float:
    """The i.i.d. acceptance that would give this τ (accepts come in runs, so it beats the raw α)."""
    if tau >= gamma + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, gamma) < tau else (lo, mid)
    return (lo + hi) / 2


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
    # per draft kind ("int8", ...): the same sublayer costs measured on the draft weights (draft.py)
    drafts: dict[str, dict] = field(default_factory=dict)
    # the device the costs were measured on (engine.device.device_label); older profiles: the CPU
    device: str = "cpu"

    @property
    def device_words(self) -> str:
        """The profiled device in words, e.g. "cpu (2 threads)" (older profiles: threads from `machine`)."""
        threads = self.machine.get("threads")
        words = self.device
        if self.device == "cpu" and threads:
            words = f"cpu ({threads} thread{'' if threads == 1 else 's'})"
        where = self.machine.get("source")
        if self.machine.get("provisional"):
            where = "provisional: not measured on this machine yet"
        return words + (f", {where}" if where else "")

    @property
    def provisional(self) -> bool:
        """True while these costs come from another machine and this one's are still being measured."""
        return bool(self.machine.get("provisional"))

    # --- costs -------------------------------------------------------------------------------
    def attn_time(self, context_len: int) -> float:
        return self.attn_a + self.attn_b * context_len

    def _costs(self, kind: str) -> dict:
        """Sublayer costs of a draft kind; a kind the profile lacks (older calibrations) costs as fp32."""
        return self.drafts.get(kind) or {"attn_a": self.attn_a, "attn_b": self.attn_b, "mlp": self.mlp,
                                         "head": self.head, "overhead": self.overhead}

    def sublayer_times(self, context_len: int = 256, kind: str = "fp32") -> tuple[float, float]:
        """Seconds one attention and one MLP sublayer take (what skipping one saves)."""
        c = self._costs(kind)
        return c["attn_a"] + c["attn_b"] * context_len, c["mlp"]

    def step_time(self, skip: SkipSet = EMPTY, context_len: int = 256, kind: str = "fp32") -> float:
        """One single-token forward; `kind` names the draft weights it reads (fp32 = the model's own)."""
        return self.pass_time(1, context_len, kind, skip)

    def draft_cost(self, skip: SkipSet, context_len: int = 256, kind: str = "fp32") -> float:
        """c: one draft step relative to one full step."""
        return self.step_time(skip, context_len, kind) / self.step_time(EMPTY, context_len)

    def knows(self, kind: str) -> bool:
        """Whether draft costs of this kind were profiled (older calibrations only have fp32)."""
        return kind == "fp32" or kind in self.drafts

    def stale_for(self, backbone) -> str | None:
        """Why these costs do not describe `backbone` on this machine (None when they do): another device,
        another CPU or thread count, or another verifier kernel than the one profiled. Costs measured on
        one CPU rank drafts wrongly on another (kernel rankings flip between AVX2 and AVX-512 machines)."""
        here = device_label(backbone.device)
        if not same_device(self.device, here):
            return f"profiled on {self.device_words}, running on {here}"
        if backbone.device.type == "cpu":
            cpu = self.machine.get("cpu")
            if not same_cpu(cpu, cpu_info()):
                return f"profiled on {cpu_words(cpu)}, running on {cpu_words(cpu_info())}"
        if self.machine.get("kernel", backbone.kernel) != backbone.kernel:
            return f"profiled with the {self.machine['kernel']} verifier kernel, running {backbone.kernel}"
        return None

    def verify_cost(self, k: int) -> float:
        """v: a verification pass over k tokens relative to one full step (interpolated)."""
        keys = sorted(self.verify)
        if k in self.verify:
            return self.verify[k]
        if k <= keys[0] or len(keys) == 1:      # one measured size: nothing to extrapolate with
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
                         context_len: int = 256, kind: str = "fp32") -> float:
        """E[tokens per step] / (γ·c + v(γ+1)): tokens per unit time vs autoregressive."""
        return speedup(acceptance, self.draft_cost(skip, context_len, kind), self.verify_cost(gamma + 1), gamma)

    def best_gamma(self, skip: SkipSet, acceptance: float, max_gamma: int, context_len: int = 256,
                   kind: str = "fp32") -> int:
        """The draft length (1..max_gamma) with the most expected tokens per unit time."""
        return max(range(1, max_gamma + 1),
                   key=lambda g: self.expected_speedup(skip, acceptance, g, context_len, kind))

    def breakdown(self, skip: SkipSet, acceptance: float, gamma: int, context_len: int = 256,
                  kind: str = "fp32") -> dict:
        """Every number of the cost panel, in one place."""
        c = self.draft_cost(skip, context_len, kind)
        v = self.verify_cost(gamma + 1)
        e = expected_tokens(acceptance, gamma)
        return {"draft_cost": c, "verify_cost": v, "expected_tokens": e,
                "step_cost": gamma * c + v, "predicted_speedup": speedup(acceptance, c, v, gamma),
                "best_speedup": speedup(1.0, c, v, gamma), "break_even": break_even(c, v, gamma),
                "full_step_ms": 1000 * self.step_time(EMPTY, context_len),
                "draft_step_ms": 1000 * self.step_time(skip, context_len, kind), "draft_kind": kind,
                "attn_ms": 1000 * self.attn_time(context_len), "mlp_ms": 1000 * self.mlp,
                "head_ms": 1000 * self.head, "overhead_ms": 1000 * self.overhead,
                "acceptance": acceptance, "gamma": gamma, "context_len": context_len}

    # --- one schema for every pass ----------------------------------------------------------------
    def pass_time(self, tokens: int = 1, context_len: int = 256, kind: str = "fp32", skip: SkipSet = EMPTY,
                  rows: int = 1, kv_share: float = 1.0) -> float:
        """Seconds of one forward pass: `rows` sequences of `tokens` new tokens each, at `context_len`
        past tokens, on the weights of `kind` with `skip`'s sublayers left out, reading `kv_share` of
        the cache (attention's context term is the KV it reads). A plain step is (1, C); a draft pass
        (1, C, "int8", S); a verification pass (γ + 1, C). Only one row is profiled so far: a batched
        profile extends `verify` by rows."""
        if rows != 1:
            raise ValueError("this latency model was profiled for one row at a time")
        L, c = self.n_layers, self._costs(kind)
        attn = c["attn_a"] + c["attn_b"] * context_len * kv_share
        # a set that keeps part of each MLP's channels (SkipSet.keep) reads that share of its weights
        one = c["overhead"] + c["head"] + (L - len(skip.attn)) * attn + (L - len(skip.mlp)) * c["mlp"] * skip.keep
        return one if tokens == 1 else one * self.verify_cost(tokens)

    def run_time(self, steps, kind: str = "fp32") -> tuple[float, float]:
        """(seconds the model predicts for a run's steps as they ran — each step's model drafts, lookup
        drafts (free), verified length and context —, seconds it predicts for plain decoding of the same
        tokens). Their ratio is the speedup this model predicts for what the run did."""
        spec = plain = 0.0
        for s in steps:
            ctx, k = s.context_len, len(s.drafted)
            if s.skip is None:
                spec += self.pass_time(1, ctx)
            else:
                if s.source == "model":
                    spec += sum(self.pass_time(1, ctx + i, kind, s.skip) for i in range(k))
                spec += self.pass_time(k + 1, ctx)
            plain += sum(self.pass_time(1, ctx + i) for i in range(len(s.committed)))
        return spec, plain

    def predicted_run_speedup(self, steps, kind: str = "fp32") -> float | None:
        spec, plain = self.run_time(steps, kind)
        return plain / spec if spec > 0 else None

    def break_even_acceptance(self, skip: SkipSet, gamma: int, context_len: int = 256,
                              kind: str = "fp32") -> float | None:
        """Smallest acceptance at which speculation stops losing (None if it never does)."""
        return break_even(self.draft_cost(skip, context_len, kind), self.verify_cost(gamma + 1), gamma)

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
def _unturned():
    return contextlib.nullcontext()


def _time_forward(bb: Backbone, cache, n_tokens: int, context: int, skip: SkipSet, repeats: int,
                  draft=None, turn=_unturned) -> float:
    """Seconds of one forward of `n_tokens` at `context` (the minimum of `repeats`), all taken inside one
    `turn()`: profiles.Quiet.slice in the app, so that no visitor's work runs beside the clock."""
    ids = [1] * n_tokens
    times = []
    with turn():
        for _ in range(repeats):
            cache.length = context
            bb.sync()                     # CUDA runs kernels asynchronously: time finished work only
            t = time.perf_counter()
            bb.forward(ids, cache, skip, logits="all" if n_tokens > 1 else "last", draft=draft)
            bb.sync()
            times.append(time.perf_counter() - t)
    cache.length = 0
    # the minimum: timing noise on a shared CPU only ever adds time
    return min(times)


def _fit_line(xs, ys) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


def _sublayer_costs(bb: Backbone, cache, contexts, repeats: int, bar, draft=None, turn=_unturned) -> dict:
    """Attention (linear in context), MLP, lm_head and overhead seconds for one kind of weights."""
    L = bb.n_layers
    all_attn = SkipSet(frozenset(range(L)), frozenset())
    all_mlp = SkipSet(frozenset(), frozenset(range(L)))
    nothing = SkipSet(frozenset(range(L)), frozenset(range(L)))
    for c in contexts:                                              # warm-up
        _time_forward(bb, cache, 1, c, EMPTY, 2, draft, turn)
    raw, points = {}, []
    for c in contexts:
        for s in (EMPTY, all_attn, all_mlp, nothing):
            raw[(c, s)] = _time_forward(bb, cache, 1, c, s, repeats, draft, turn)
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
    x = torch.zeros(1, bb.hidden, dtype=bb.dtype, device=bb.device)
    head_fn = (lambda: bb.head_logits(x)) if draft is None else (lambda: draft.head(x))
    head_times = []
    with turn():
        for _ in range(repeats):
            bb.sync()
            t = time.perf_counter()
            head_fn()
            bb.sync()
            head_times.append(time.perf_counter() - t)
    head = min(head_times)
    bar.update()
    return {"attn_a": max(a, 1e-6), "attn_b": max(b, 0.0), "mlp": mlp, "head": head,
            "overhead": max(bare - head, 0.0), "points": points}


def profile(bb: Backbone, contexts=(64, 512, 1024, 2048), verify_ks=(1, 2, 3, 4, 5, 7, 9),
            repeats: int = 9, progress: bool = True, drafts=("int8",), turn=None) -> LatencyModel:
    """Measure sublayer, lm_head, overhead and verify costs with real forwards on the model's device.

    drafts: draft kinds (draft.py) whose costs are measured too, each on its own weights (with the
    backbone's small draft head, if one is installed).
    turn: a context manager factory each timing runs inside (profiles.Quiet.slice: an idle engine).
    """
    turn = turn or _unturned
    contexts = [c for c in contexts if c + max(verify_ks) + 2 <= bb.max_positions]
    cache = bb.new_cache(max(contexts) + max(verify_ks) + 2)
    per_kind = 4 * len(contexts) + 1
    bar = tqdm(total=per_kind * (1 + len(drafts)) + len(verify_ks), desc="latency profile",
               disable=not progress)
    cache.k.fill_(0.0), cache.v.fill_(0.0)                          # fault in every page now
    full = _sublayer_costs(bb, cache, contexts, repeats, bar, turn=turn)
    kinds = {}
    for kind in drafts:
        costs = _sublayer_costs(bb, cache, contexts, repeats, bar, bb.drafts.get(kind), turn)
        costs.pop("points")
        kinds[kind] = costs
    # verification is timed at the shortest profiled context: the app's runs verify at 60–300 tokens
    ref = contexts[0]
    one = _time_forward(bb, cache, 1, ref, EMPTY, repeats, turn=turn)
    verify = {}
    for k in verify_ks:
        verify[k] = round(_time_forward(bb, cache, k, ref, EMPTY, repeats, turn=turn) / one, 4) if k > 1 else 1.0
        bar.update()
    bar.close()
    # No "more tokens never cost less" correction: a pass's kernel depends on its shape, and on an AMD
    # EPYC (AVX-512) verifying 2 tokens costs 1.29 steps but 5 tokens 1.08 (context 64, quiet). Forcing
    # the table up to its running maximum priced every 3–5-token pass at 1.31 and the cost panel's
    # prediction came out 6–11% under the measured speedups on all seven domains.
    machine = {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "verify_context": ref, "kernel": bb.kernel, "cpu": cpu_info()}
    points = full.pop("points")
    return LatencyModel(n_layers=bb.n_layers, verify=verify, measured=points, machine=machine,
                        drafts=kinds, device=device_label(bb.device), **full)


def check(bb: Backbone, lat: LatencyModel, repeats: int = 9, turn=None) -> float:
    """A fresh timing of one full step at the profile's first context ÷ the profile's own timing of it
    (the same measurement, not the fitted line, which is off at the ends): near 1 when the machine stayed
    in one state while it was profiled, far from it when another process's burst overlapped part of it."""
    point = lat.measured[0]
    context = point["context"]
    cache = bb.new_cache(context + 2)
    cache.k.fill_(0.0), cache.v.fill_(0.0)
    return _time_forward(bb, cache, 1, context, EMPTY, repeats, turn=turn or _unturned) / (point["full_ms"] / 1000)


def fit_report(model: LatencyModel) -> list[dict]:
    """Predicted vs measured full-step time at every profiled context (the fit, for the README)."""
    out = []
    for p in model.measured:
        pred = 1000 * model.step_time(EMPTY, p["context"])
        out.append({"context": p["context"], "measured_ms": round(p["full_ms"], 2),
                    "predicted_ms": round(pred, 2), "error_pct": round(100 * (pred / p["full_ms"] - 1), 1)})
    return out
