"""Core speed benchmark: model.generate vs the core's AR loop vs SSD, same process.

    python -m ssd_core.tools.microbench --out assets/bench/core.json

Reports tokens/s, achieved weight-read bandwidth (GB/s) and the share of a
speculative step spent outside the forwards.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from ..engine.decode import DecodeConfig
from ..engine.generate import generate
from ..engine.loading import load_backbone
from ..engine.skipset import SkipSet
from ..policies.ar import Autoregressive
from ..policies.static import Static

PROMPTS = [
    "Explain in a few sentences why the sky looks blue during the day.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize: The town council voted on Tuesday to extend the library's opening hours after a "
    "petition signed by more than two thousand residents.",
]


def example_skip(n_layers: int) -> SkipSet:
    """A fixed illustrative set: every other middle MLP and a few middle attentions."""
    mid = range(n_layers // 4, 3 * n_layers // 4)
    return SkipSet(frozenset(list(mid)[::4]), frozenset(list(mid)[1::3]), name="example")


def _hf_generate_tps(bb, prompt: str, n: int) -> float:
    ids = torch.tensor([bb.encode(prompt).ids], device=bb.device)
    with torch.inference_mode():
        t = time.perf_counter()
        out = bb.hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) / dt


def run(model: str | None, n: int, rounds: int, gamma: int) -> dict:
    bb = load_backbone(model, threads=torch.get_num_threads())
    skip = example_skip(bb.n_layers)
    cfg = DecodeConfig(max_new_tokens=n, gamma=gamma, stop_at_eos=False)
    results = {"generate": [], "core_ar": [], "ssd": []}
    ssd_runs = []
    _hf_generate_tps(bb, PROMPTS[0], 8)                     # warm-up
    generate(bb, PROMPTS[0], Static(skip), cfg)
    for _ in range(rounds):
        for p in PROMPTS:                                  # interleaved: drift hits all equally
            results["generate"].append(_hf_generate_tps(bb, p, n))
            results["core_ar"].append(generate(bb, p, Autoregressive(), cfg).stats.tokens_per_s)
            g = generate(bb, p, Static(skip), cfg)
            results["ssd"].append(g.stats.tokens_per_s)
            ssd_runs.append(g.stats)
    mean = {k: sum(v) / len(v) for k, v in results.items()}
    gb = bb.weight_bytes() / 1e9
    step_time = sum(s.draft_s + s.verify_s + s.overhead_s for s in ssd_runs)
    overhead = sum(s.overhead_s for s in ssd_runs)
    return {
        "model": bb.name, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "max_new_tokens": n, "rounds": rounds, "prompts": len(PROMPTS), "gamma": gamma,
        "tokens_per_s": {k: round(v, 2) for k, v in mean.items()},
        "core_ar_vs_generate": round(mean["core_ar"] / mean["generate"], 3),
        "ssd_vs_core_ar": round(mean["ssd"] / mean["core_ar"], 3),
        "weights_gb_per_step": round(gb, 3),
        "bandwidth_gb_s": {"generate": round(gb * mean["generate"], 1),
                           "core_ar": round(gb * mean["core_ar"], 1)},
        "ssd_skip_set": skip.to_dict(),
        "ssd_skip_weight_ratio": round(bb.skip_weight_ratio(skip), 3),
        "ssd_tau": round(sum(s.tau for s in ssd_runs) / len(ssd_runs), 3),
        "ssd_alpha": round(sum(s.alpha for s in ssd_runs) / len(ssd_runs), 3),
        "ssd_non_forward_share": round(overhead / step_time, 4),
        "samples": {k: [round(x, 2) for x in v] for k, v in results.items()},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model spec (default: embedded SmolLM2-135M)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="assets/bench/core.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = run(args.model, args.max_new_tokens, args.rounds, args.gamma)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: res[k] for k in ("tokens_per_s", "core_ar_vs_generate", "ssd_vs_core_ar",
                                          "bandwidth_gb_s", "ssd_tau", "ssd_non_forward_share")}, indent=2))


if __name__ == "__main__":
    main()
