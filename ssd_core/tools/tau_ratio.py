"""How sure is a τ ratio? A paired bootstrap over the prompts of one benchmark run.

    python -m ssd_core.tools.tau_ratio assets/bench/knnssd_heldout_mix1 [--a knn --b static]

Reads `<a>.jsonl` and `<b>.jsonl` (Spec-Bench answers written by `python -m ssd_core.bench`), pools τ
as the bench does (tokens committed by verification steps ÷ steps, over every prompt), and resamples
the prompts with replacement (the same prompts for both strategies) to give a 95% interval for
τ(a) / τ(b) and the share of resamples at or above a goal. With a few prompts per category the
interval is wide: it says whether a ratio near a goal is a miss or noise.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .specbench import load_answers


def step_lengths(answers) -> dict:
    """question_id → the accept lengths (tokens per verification step) of its first turn; `answers` is a
    Spec-Bench answer file or its records (specbench.load_answers)."""
    rows = load_answers(answers) if isinstance(answers, (str, Path)) else answers
    return {a["question_id"]: a["choices"][0]["accept_lengths"][0] for a in rows}


def pooled_tau(lengths: dict) -> float:
    """τ as the bench pools it: tokens committed by every verification step ÷ steps, over all prompts."""
    steps = [n for per in lengths.values() for n in per]
    return sum(steps) / max(len(steps), 1)


def tau_ratio(a: dict, b: dict, resamples: int = 5000, goal: float | None = None, seed: int = 0) -> dict:
    """Pooled τ(a) / τ(b) over the prompts both ran, with a paired 95% bootstrap interval."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("the two strategies share no prompt")
    sums = np.array([[sum(a[i]), len(a[i]), sum(b[i]), len(b[i])] for i in ids], dtype=float)

    def ratio(rows):
        t = rows.sum(axis=0)
        return (t[0] / t[1]) / (t[2] / t[3])

    rng = np.random.default_rng(seed)
    draws = np.array([ratio(sums[rng.integers(0, len(ids), len(ids))]) for _ in range(resamples)])
    lo, hi = np.percentile(draws, [2.5, 97.5])
    res = {"prompts": len(ids), "tau_a": sums[:, 0].sum() / sums[:, 1].sum(),
           "tau_b": sums[:, 2].sum() / sums[:, 3].sum(), "ratio": ratio(sums), "ci95": (float(lo), float(hi))}
    if goal is not None:
        res["share_at_or_above_goal"] = float((draws >= goal).mean())
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a benchmark output folder")
    ap.add_argument("--a", default="knn", help="numerator strategy (default knn)")
    ap.add_argument("--b", default="static", help="denominator strategy (default static)")
    ap.add_argument("--goal", type=float, default=1.15, help="report the share of resamples ≥ this")
    ap.add_argument("--resamples", type=int, default=5000)
    args = ap.parse_args(argv)
    r = tau_ratio(step_lengths(args.run / f"{args.a}.jsonl"), step_lengths(args.run / f"{args.b}.jsonl"),
                  args.resamples, args.goal)
    lo, hi = r["ci95"]
    print(f"{args.run}: τ({args.a}) {r['tau_a']:.3f} / τ({args.b}) {r['tau_b']:.3f} = {r['ratio']:.3f} over "
          f"{r['prompts']} prompts; 95% bootstrap interval [{lo:.3f}, {hi:.3f}]; "
          f"{r['share_at_or_above_goal']:.0%} of resamples ≥ {args.goal}")


if __name__ == "__main__":
    main()
