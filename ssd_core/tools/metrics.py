"""The statistics every tool reports, defined once: pooled τ / α / tokens/s and speedups against ar.

Records are per-prompt dicts {new_tokens, wall_s, prefill_s, accept_lengths, drafted, accepted};
a group's figures are ratios of sums over its prompts (see DEFINITIONS).
"""
from __future__ import annotations

import os
import platform

import torch

DEFINITIONS = {
    "tokens_per_s": "total new tokens ÷ total wall time over the prompts of a group (prefill, routing "
                    "and every step included; the first token comes from the prefill)",
    "decode_tokens_per_s": "tokens committed by verification steps ÷ (wall time − prefill time): "
                           "the decode phase only",
    "speedup": "tokens_per_s of the strategy ÷ tokens_per_s of ar over the same prompts in the same "
               "run (both sums over the same prompts: total new tokens ÷ total wall time)",
    "decode_speedup": "decode_tokens_per_s of the strategy ÷ that of ar, same prompts",
    "speedup_median": "median over prompts of the per-prompt ratio (tokens ÷ wall of the strategy) ÷ "
                      "(tokens ÷ wall of ar): a companion to speedup that a burst of load from other "
                      "processes during one prompt cannot move much",
    "speedup_vs_hf_generate": "tokens_per_s of the strategy ÷ tokens_per_s of transformers' "
                              "model.generate (greedy), both over the prompts where model.generate ran",
    "tau": "mean accepted tokens: tokens committed per verification step, bonus token included, "
           "pooled over every step of every prompt in the group (ar = 1.0); the prefill's token "
           "is not a step",
    "alpha": "acceptance rate: accepted draft tokens ÷ drafted tokens, pooled over the group "
             "(0 when nothing was drafted)",
    "tau_iid_from_alpha": "(1 − α^(γ+1)) / (1 − α): the τ an i.i.d. acceptance α would give",
    "predicted_speedup_measured_alpha": "the calibration's latency model applied to the steps that "
                                        "happened: Σ tokens ÷ Σ step costs, a step costing (model drafts)·"
                                        "c(skip, context, draft kind) + v(drafted + 1) full steps (lookup "
                                        "drafts cost no forward); per prompt, combined over a group as "
                                        "Σ tokens ÷ Σ (tokens ÷ prediction), like tokens_per_s. Against "
                                        "the measured speedup it tests the cost model alone",
    "predicted_speedup_calibration_alpha": "expected_speedup(skip, α, γ*, context, draft kind) with the "
                                           "acceptance the calibration expects for the set used most "
                                           "(held-out matchness on its own domain with this draft kind; "
                                           "static: mean over domains; knapspec: its own estimate) and the "
                                           "best γ* ≤ γ for it: what was expected before the run",
    "lookup_steps": "verification steps whose drafts came from prompt lookup (copied from earlier text)",
    "lookup_accepted": "tokens accepted from prompt-lookup drafts",
    "ar_bandwidth_gb_s": "bytes of weights one full decode step reads (backbone.weight_bytes(), "
                         "lm_head included, KV cache not) × ar tokens_per_s ÷ 1e9",
    "lossless": "every strategy's greedy token ids and text identical to ar's on every prompt, and ar's "
                "token ids identical to transformers' greedy model.generate on every prompt where it ran "
                "(both cut after the first end-of-sequence token)",
    "lossless_vs_ar": "every strategy's greedy token ids and text identical to ar's on every prompt",
    "lossless_vs_hf": "ar's token ids identical to greedy model.generate's on every prompt where it ran "
                      "(null when it never ran): an independent check of the core's forward",
    "routing": "per category, how many prompts the KNN router sent to each domain ('unknown' = "
               "below the router's similarity threshold → static set)",
    "mix_ratio": "order of the stream: 0 = contiguous category blocks (file order); 1 = the category "
                 "changes after every prompt (round-robin); between: at each position the stream "
                 "switches to the next category (cyclic order) with probability R (seeded)",
}


def aggregate(records: list[dict]) -> dict:
    """Group figures from per-prompt records {new_tokens, wall_s, prefill_s, accept_lengths, drafted,
    accepted}: tokens/s = Σ tokens ÷ Σ wall, τ pooled over steps, α = Σ accepted ÷ Σ drafted."""
    tokens = sum(r["new_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    lengths = [n for r in records for n in r["accept_lengths"]]
    decode_wall = sum(r["wall_s"] - r.get("prefill_s", 0.0) for r in records)
    drafted = sum(r.get("drafted", 0) for r in records)
    accepted = sum(r.get("accepted", 0) for r in records)
    return {
        "prompts": len(records), "new_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "decode_tokens_per_s": sum(lengths) / decode_wall if decode_wall > 0 else 0.0,
        "steps": len(lengths),
        "tau": sum(lengths) / len(lengths) if lengths else 1.0,
        "drafted": drafted, "accepted": accepted,
        "alpha": accepted / drafted if drafted else 0.0,
    }


def speedup(records: list[dict], ar_records: list[dict], key: str = "tokens_per_s") -> float | None:
    """Ratio of aggregate tokens/s (or decode tokens/s) over the same prompts."""
    ours, base = aggregate(records)[key], aggregate(ar_records)[key]
    return ours / base if base > 0 else None


def median_speedup(records: list[dict], ar_records: list[dict]) -> float | None:
    """Median of per-prompt tokens/s ratios; records and ar_records are the same prompts in order."""
    ratios = sorted((r["new_tokens"] / r["wall_s"]) / (a["new_tokens"] / a["wall_s"])
                    for r, a in zip(records, ar_records)
                    if r["wall_s"] > 0 and a["wall_s"] > 0 and a["new_tokens"] > 0)
    if not ratios:
        return None
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def combine_predictions(records: list[dict], key: str) -> float | None:
    """Σ tokens ÷ Σ (tokens ÷ predicted speedup): the group's predicted tokens/s ratio."""
    pairs = [(r["new_tokens"], r.get(key)) for r in records]
    if not pairs or any(p is None or p <= 0 for _, p in pairs):
        return None
    total = sum(n for n, _ in pairs)
    return total / sum(n / p for n, p in pairs) if total else None


def round_or_none(x, digits: int = 4):
    """x rounded for the JSON (None stays None)."""
    return None if x is None else round(float(x), digits)


def group_stats(records: list[dict], ar_records: list[dict]) -> dict:
    """One group's figures against ar on the same prompts, rounded for the JSON."""
    agg = aggregate(records)
    return {
        "tokens_per_s": round_or_none(agg["tokens_per_s"], 3),
        "decode_tokens_per_s": round_or_none(agg["decode_tokens_per_s"], 3),
        "speedup": round_or_none(speedup(records, ar_records)),
        "decode_speedup": round_or_none(speedup(records, ar_records, "decode_tokens_per_s")),
        "tau": round_or_none(agg["tau"]), "alpha": round_or_none(agg["alpha"]),
        "prompts": agg["prompts"], "new_tokens": agg["new_tokens"], "wall_s": round_or_none(agg["wall_s"], 3),
        "steps": agg["steps"], "drafted": agg["drafted"], "accepted": agg["accepted"],
    }


def first_difference(a, b) -> int:
    """The first position where two token sequences differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def machine() -> dict:
    """The machine a run happened on (its load average too: other processes slow every strategy)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_at_start": [round(x, 2) for x in load] if load else None}


def rss_mb() -> float | None:
    """Resident memory of this process (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def draft_memory(backbone, draft: str) -> dict:
    """What the draft copy costs in memory: RSS before / after building it, and its own bytes."""
    before = rss_mb()
    weights = backbone.drafts.get(draft)
    after = rss_mb()
    extra = weights.extra_bytes() if weights is not None else 0
    fp32 = backbone.weight_bytes() + backbone.embed.numel() * backbone.embed.element_size() * (
        backbone.lm_head.data_ptr() != backbone.embed.data_ptr())
    return {"rss_before_draft_mb": before, "rss_after_draft_mb": after,
            "draft_bytes_mb": round(extra / 2 ** 20, 1), "model_bytes_mb": round(fp32 / 2 ** 20, 1),
            "draft_extra_ratio": round(extra / fp32, 4)}
