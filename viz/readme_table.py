"""The README's "results at a glance" block, generated from committed runs, never typed.

    python -m viz.readme_table            # rewrite the block between the markers in README.md
    python -m viz.readme_table --check    # exit 1 if README.md's block differs from the committed runs

Sources: the headline run named in assets/bench/README.md (`<!-- headline: RUN -->`, its summary.json)
and assets/bench/baselines.json (`python -m ssd_core.tools.baselines`). When numbers move, re-run the
bench or the baselines, then this; tests/test_readme_table.py fails while the README is stale.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ssd_core.policies.registry import LABELS

from .benchmark import ROOT, headline_name

START = "<!-- results-table:start (written by `python -m viz.readme_table` from assets/bench/; do not edit) -->"
END = "<!-- results-table:end -->"
ORDER = ("ar", "static", "knn", "oracle", "knapspec", "auto")


def _x(v: float) -> str:
    return f"{v:.2f}×"


def headline_table(summary: dict, run: str) -> list[str]:
    s = summary["settings"]
    failures = {f.get("strategy") for f in summary.get("lossless_failures") or [] if isinstance(f, dict)}
    n = summary.get("hf_generate_prompts") or len(summary.get("order") or [])
    strategies = summary["strategies"]
    names = [k for k in ORDER if k in strategies] + [k for k in strategies if k not in ORDER]
    draft = s.get("draft_label", "") + (" + prompt lookup" if s.get("lookup") else "") + \
        (", adaptive γ ≤ " if s.get("adaptive_gamma") else ", γ = ") + str(s.get("gamma"))
    lines = [f"Headline run [`assets/bench/{run}/`](assets/bench/{run}/results.md): {n} prompts "
             f"(`{s.get('questions')}`), {s.get('max_new_tokens')} new tokens, "
             + ("the category changing after every prompt, " if s.get("mix_ratio") == 1 else "")
             + f"{draft}, {summary.get('device', 'cpu')}, {summary.get('started', '')[:10]}. "
             "All strategies ran interleaved in one process; speedup = tokens/s ÷ the core's own "
             "autoregressive loop's tokens/s in that run.", "",
             "| decoding | tokens/s | speedup vs core AR | τ | α | output identical to AR |",
             "|---|---|---|---|---|---|"]
    for k in names:
        st = strategies[k]
        label = "core AR (plain decoding: the baseline)" if k == "ar" else f"{LABELS.get(k, k)} (`{k}`)"
        same = "–" if k == "ar" else ("✗" if k in failures or summary.get("lossless_vs_ar") is False else "✓")
        alpha = "–" if k == "ar" else f"{st['alpha']:.2f}"
        lines.append(f"| {label} | {st['tokens_per_s']:.1f} | {_x(st['speedup'])} | {st['tau']:.2f} | {alpha} "
                     f"| {same} |")
    hf = summary.get("hf_generate_tokens_per_s")
    if hf:
        ar = strategies["ar"]["tokens_per_s"]
        lines.append(f"| transformers `model.generate` (same run) | {hf:.1f} | {_x(hf / ar)} | 1.00 | – "
                     f"| {summary.get('hf_generate_matches_ar', '?')} |")
    return lines


def baseline_table(base: dict) -> list[str]:
    load = base.get("load_note", {})
    tps = base["core"]["tokens_per_s"]
    core, ssd = tps["core_ar"], tps.get("ssd")
    pairs = f", median of {base['pairs']} interleaved pairs" if base.get("pairs") else ""
    lines = [f"What a CPU user would run instead, [`assets/bench/baselines.json`](assets/bench/baselines.json) "
             f"(`python -m ssd_core.tools.baselines`): llama.cpp's `llama-bench` on the same GGUF and the "
             f"core's decoding in one process window, {base['threads']} threads, {base['n_gen']} tokens, decode "
             f"only{pairs}, {base.get('cpu') or 'CPU not recorded'}, {base.get('date', '')}, 1-minute load "
             f"{load.get('loadavg_1min_start', '?')} → {load.get('loadavg_1min_end', '?')} on "
             f"{load.get('cores', '?')} cores.", ""]
    if ssd is None:
        lines += ["| decoder | tokens/s | core AR ÷ it |", "|---|---|---|",
                  f"| core AR (`microbench`, same window) | {core:.1f} | 1.00× |"]
    else:
        held = base["core"].get("heldout") or {}
        lines += ["| decoder | tokens/s | core AR ÷ it | the app's decoding ÷ it |", "|---|---|---|---|",
                  f"| core AR (`microbench`, short prompt, EOS off) | {core:.1f} | 1.00× | – |"]
        if held.get("core_ar"):
            lines.append(f"| core AR on the app's held-out prompts (EOS on) | {held['core_ar']:.1f} | – | "
                         f"{held['ssd_vs_core_ar']:.2f}× (paired) |")
        lines.append(f"| the app's decoding (`knn`, held-out prompts, EOS on) | {ssd:.1f} | – | 1.00× |")
    for prec, r in base["llama_cpp"]["tokens_per_s"].items():
        spread = (f"{min(r['samples']):.1f}–{max(r['samples']):.1f}" if r.get("samples")
                  else f"± {r.get('stddev', '?')}")
        row = f"| llama.cpp {prec} ({spread}) | {r['tokens_per_s']:.1f} | {_x(core / r['tokens_per_s'])} |"
        lines.append(row + (f" {_x(ssd / r['tokens_per_s'])} |" if ssd is not None else ""))
    return lines


def render(bench_dir: Path) -> str:
    """The block's text (markers included) from the committed files under bench_dir."""
    run = headline_name(bench_dir)
    if run is None:
        raise SystemExit(f"{bench_dir}/README.md names no headline run (<!-- headline: RUN -->)")
    lines = [START, ""] + headline_table(json.loads((bench_dir / run / "summary.json").read_text("utf-8")), run)
    base = bench_dir / "baselines.json"
    if base.exists():
        lines += [""] + baseline_table(json.loads(base.read_text("utf-8")))
    return "\n".join(lines + ["", END])


def replace_block(readme: str, block: str) -> str:
    """README text with the block between the markers replaced (the markers must be there, once)."""
    i, j = readme.find(START), readme.find(END)
    if i < 0 or j < i or readme.count(START) != 1:
        raise ValueError("README.md needs exactly one results-table block (start and end markers)")
    return readme[:i] + block + readme[j + len(END):]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--bench", default=str(ROOT / "assets" / "bench"))
    ap.add_argument("--check", action="store_true", help="only say whether the README is current")
    args = ap.parse_args(argv)
    path = Path(args.readme)
    old = path.read_text(encoding="utf-8")
    new = replace_block(old, render(Path(args.bench)))
    if args.check:
        print("README.md results table is current" if new == old else
              "README.md results table is stale: run python -m viz.readme_table")
        return 0 if new == old else 1
    path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
