"""Benchmark figures: summary / answers data in → markdown tables and plotly figures out.

Pure functions, plus `render(folder)`, which writes the tables and figures of a folder that
`python -m ssd_core.bench` or `python -m ssd_core.scaling` filled, beside its data:

    python -m viz.bench_figures assets/bench/heldout_mix1_onednn
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import plotly.graph_objects as go

from ssd_core.policies.registry import BASELINE
from ssd_core.tools.tau_ratio import pooled_tau, step_lengths, tau_ratio

from .theme import STRATEGY_COLOURS


def _colour(name: str) -> str:
    return STRATEGY_COLOURS.get(name, "#bcbd22")


def _num(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}"


def _categories(summary: dict) -> list[str]:
    """Categories in the order the summary lists them (file order)."""
    cats = summary.get("categories")
    if cats:
        return list(cats)
    seen: dict[str, None] = {}
    for s in summary["strategies"].values():
        for c in s.get("per_category", {}):
            seen.setdefault(c, None)
    return list(seen)


# --- markdown ---------------------------------------------------------------------------------
def overall_table(summary: dict) -> str:
    """One row per strategy: the whole run."""
    hf = summary.get("hf_generate_tokens_per_s")
    head = ("| strategy | tokens/s | speedup vs ar | median per-prompt speedup | speedup vs model.generate "
            "| τ | α | predicted (measured α) | predicted (calibration α) |")
    rows = [head, "|" + "---|" * 9]
    for name, s in summary["strategies"].items():
        rows.append(f"| {name} | {_num(s['tokens_per_s'], 1)} | {_num(s['speedup'], 3)} "
                    f"| {_num(s.get('speedup_median'), 3)} "
                    f"| {_num(s.get('speedup_vs_hf_generate'), 3) if hf else '–'} "
                    f"| {_num(s['tau'])} | {_num(s['alpha'])} "
                    f"| {_num(s.get('predicted_speedup_measured_alpha'), 3)} "
                    f"| {_num(s.get('predicted_speedup_calibration_alpha'), 3)} |")
    return "\n".join(rows)


def category_table(summary: dict) -> str:
    """One row per (category, strategy): τ, α, tokens/s and speedup."""
    rows = ["| category | strategy | τ | α | tokens/s | speedup vs ar | median per-prompt speedup "
            "| predicted (measured α) |", "|" + "---|" * 8]
    for cat in _categories(summary):
        for name, s in summary["strategies"].items():
            c = s.get("per_category", {}).get(cat)
            if c is None:
                continue
            rows.append(f"| {cat} | {name} | {_num(c['tau'])} | {_num(c['alpha'])} "
                        f"| {_num(c['tokens_per_s'], 1)} | {_num(c['speedup'], 3)} "
                        f"| {_num(c.get('speedup_median'), 3)} "
                        f"| {_num(c.get('predicted_speedup_measured_alpha'), 3)} |")
    return "\n".join(rows)


def routing_table(summary: dict) -> str:
    """Where the KNN router sent each category's prompts."""
    routing = summary.get("routing") or {}
    targets = sorted({d for counts in routing.values() for d in counts})
    if not targets:
        return ""
    rows = ["| category | oracle domain | " + " | ".join(targets) + " |", "|" + "---|" * (len(targets) + 2)]
    oracle = summary.get("oracle_domains", {})
    for cat, counts in routing.items():
        rows.append(f"| {cat} | {oracle.get(cat, '–')} | "
                    + " | ".join(str(counts.get(d, 0)) for d in targets) + " |")
    return "\n".join(rows)


def _gamma(settings: dict) -> str:
    """γ as the run used it: fixed, or the most the latency model may choose per step."""
    g = settings.get("gamma")
    if "adaptive_gamma" not in settings:                      # runs before the flag was recorded
        return f"γ: {g}"
    return f"γ ≤ {g} (adaptive)" if settings["adaptive_gamma"] else f"γ = {g} (fixed)"


def routing_gain(answers: dict) -> str:
    """KNN-SSD's claim in one paragraph: τ(knn) / τ(static) with a paired bootstrap over the prompts
    (ssd_core.tools.tau_ratio), and τ(knn) / τ(oracle); "" unless the run has knn and static answers."""
    if not (answers.get("knn") and answers.get("static")):
        return ""
    knn = step_lengths(answers["knn"])
    r = tau_ratio(knn, step_lengths(answers["static"]))
    lo, hi = r["ci95"]
    text = (f"τ(knn) / τ(static) = {r['tau_a']:.3f} / {r['tau_b']:.3f} = **{r['ratio']:.3f}** over "
            f"{r['prompts']} prompts (95% paired bootstrap interval [{lo:.3f}, {hi:.3f}])")
    if answers.get("oracle"):
        text += f"; τ(knn) / τ(oracle) = {pooled_tau(knn) / pooled_tau(step_lengths(answers['oracle'])):.3f}"
    return text + ". τ counts the tokens each verification commits, so the verifier's own token is in both."


def markdown_report(summary: dict, answers: dict | None = None) -> str:
    """The bench's results.md: overall, per category, routing (with routing_gain when `answers`, the
    strategies' answer records, are given), and how the numbers were measured."""
    hf = summary.get("hf_generate_tokens_per_s")
    bw = summary.get("ar_bandwidth_gb_s")
    lat = summary.get("settings", {}).get("latency_profiled_on")     # the CLI records it
    lines = [f"# Benchmark: {summary.get('model', '?')}", "",
             f"lossless: **{summary.get('lossless')}**  ·  prompts: {len(summary.get('order', []))}  ·  "
             f"max new tokens: {summary.get('settings', {}).get('max_new_tokens')}  ·  "
             f"{_gamma(summary.get('settings', {}))}  ·  "
             f"mix ratio: {summary.get('settings', {}).get('mix_ratio')}  ·  "
             f"truncated prompts: {summary.get('truncated_prompts', 0)}", "",
             f"device: **{summary.get('device') or 'cpu'}**"          # runs before it was recorded: all CPU
             + (f"  ·  latency model profiled on: {lat}" if lat else ""), ""]
    if hf:
        lines += [f"`model.generate` greedy: {hf:.1f} tokens/s; the core's `ar` loop reaches "
                  f"{_num(summary.get('ar_vs_hf_generate'), 3)}× that on the same prompts; "
                  f"`ar` reads weights at {_num(bw, 1)} GB/s.", ""]
    elif bw:
        lines += [f"`ar` reads weights at {bw:.1f} GB/s.", ""]
    lines += ["## All prompts", "", overall_table(summary), "", "## Per category", "",
              category_table(summary), ""]
    rt = routing_table(summary)
    if rt:
        lines += ["## KNN routing (prompts per domain)", "", rt, ""]
    gain = routing_gain(answers or {})
    if gain:
        lines += ["## KNN routing vs one static set", "", gain, ""]
    defs = summary.get("definitions")
    if defs:
        lines += ["## Definitions", ""] + [f"- **{k}**: {v}" for k, v in defs.items()] + [""]
    return "\n".join(lines)


# --- figures ----------------------------------------------------------------------------------
def _per_category_bars(summary: dict, key: str, title: str, yaxis: str, reference: float | None):
    cats = _categories(summary)
    fig = go.Figure()
    for name, s in summary["strategies"].items():
        per = s.get("per_category", {})
        fig.add_trace(go.Bar(name=name, x=cats + ["all"],
                             y=[per.get(c, {}).get(key) for c in cats] + [s.get(key)],
                             marker_color=_colour(name)))
    if reference is not None:
        fig.add_hline(y=reference, line_dash="dot", line_color="#444",
                      annotation_text="autoregressive", annotation_position="top left")
    fig.update_layout(title=title, barmode="group", xaxis_title="category", yaxis_title=yaxis,
                      template="plotly_white", legend_title="strategy")
    return fig


def tau_figure(summary: dict) -> go.Figure:
    """τ (tokens committed per verification step) per category and strategy."""
    return _per_category_bars(summary, "tau", "Mean accepted tokens τ per category", "τ", 1.0)


def speedup_figure(summary: dict) -> go.Figure:
    """Measured speedup vs ar per category (bars), with the latency model's prediction (markers)."""
    fig = _per_category_bars(summary, "speedup", "Speedup vs autoregressive (same run)",
                             "tokens/s ÷ ar tokens/s", 1.0)
    cats = _categories(summary)
    for name, s in summary["strategies"].items():
        if name == BASELINE:
            continue
        per = s.get("per_category", {})
        fig.add_trace(go.Scatter(
            name=f"{name} predicted", x=cats + ["all"], mode="markers",
            y=[per.get(c, {}).get("predicted_speedup_measured_alpha") for c in cats]
              + [s.get("predicted_speedup_measured_alpha")],
            marker=dict(symbol="diamond-open", size=10, color=_colour(name)), showlegend=True))
    return fig


def accept_length_figure(answers: dict[str, list[dict]]) -> go.Figure:
    """Histogram of tokens committed per step, per strategy, from Spec-Bench answer records."""
    fig = go.Figure()
    for name, records in answers.items():
        counts = Counter(n for r in records for choice in r["choices"]
                         for steps in choice["accept_lengths"] for n in steps)
        total = sum(counts.values())
        if not total:
            continue
        xs = sorted(counts)
        fig.add_trace(go.Bar(name=name, x=xs, y=[counts[x] / total for x in xs],
                             marker_color=_colour(name)))
    fig.update_layout(title="Accept lengths (tokens committed per verification step)", barmode="group",
                      xaxis_title="tokens committed in one step", yaxis_title="share of steps",
                      xaxis=dict(dtick=1), template="plotly_white", legend_title="strategy")
    return fig


def bench_figures(summary: dict, answers: dict[str, list[dict]]) -> dict[str, go.Figure]:
    return {"tau_per_category": tau_figure(summary), "speedup_per_category": speedup_figure(summary),
            "accept_lengths": accept_length_figure(answers)}


# --- scaling ------------------------------------------------------------------------------------
def scaling_table(scaling: dict) -> str:
    """tokens/s (decode only), τ and speedup per context length and strategy; KnapSpec's split."""
    rows = ["| prompt tokens | strategy | decode tokens/s | end-to-end tokens/s | τ | α | speedup (decode) "
            "| skip set (attn + mlp) |", "|" + "---|" * 8]
    for point in scaling["points"]:
        for name, s in point["strategies"].items():
            skip = s.get("skip_sets") or []
            split = ", ".join(f"{k['attn']}+{k['mlp']}" + (f" @{k['context_len']}" if "context_len" in k else "")
                              for k in skip) or "–"
            rows.append(f"| {point['prompt_tokens']} | {name} | {_num(s['decode_tokens_per_s'], 1)} "
                        f"| {_num(s['tokens_per_s'], 1)} | {_num(s['tau'])} | {_num(s['alpha'])} "
                        f"| {_num(s['decode_speedup'], 3)} | {split} |")
    return "\n".join(rows)


def knapspec_sweep_table(scaling: dict) -> str:
    """KnapSpec's choice against context length with one fixed similarity profile (cost side only)."""
    sweep = scaling.get("knapspec_sweep") or []
    rows = ["| context | attention ms/sublayer | MLP ms/sublayer | attn skipped | MLP skipped "
            "| predicted speedup |", "|" + "---|" * 6]
    for p in sweep:
        rows.append(f"| {p['context_len']} | {_num(p['attn_ms'], 3)} | {_num(p['mlp_ms'], 3)} "
                    f"| {p['attn']} | {p['mlp']} | {_num(p['predicted_speedup'], 3)} |")
    return "\n".join(rows)


def fixed_saving_table(scaling: dict) -> str:
    """The least-loss attention + MLP mix for a fixed time saving, per context."""
    rows_in = scaling.get("fixed_saving_sweep") or []
    shares = [k for k in (rows_in[0] if rows_in else {}) if k != "context_len"]
    if not shares:
        return ""
    rows = ["| context | " + " | ".join(f"save {float(k) * 100:.0f}%: attn + MLP" for k in shares) + " |",
            "|" + "---|" * (len(shares) + 1)]
    for r in rows_in:
        cells = [f"{r[k]['attn']} + {r[k]['mlp']}" if r.get(k) else "–" for k in shares]
        rows.append(f"| {r['context_len']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def scaling_report(scaling: dict) -> str:
    lines = [f"# Scaling with context length: {scaling.get('model', '?')}", "",
             f"{scaling.get('settings', {}).get('new_tokens')} new tokens per run, "
             f"γ = {scaling.get('settings', {}).get('gamma')}, lossless: **{scaling.get('lossless')}**, "
             f"device: {scaling.get('device') or 'cpu'}.", "",
             scaling_table(scaling), "", "## KnapSpec's choice as attention gets dearer", "",
             knapspec_sweep_table(scaling), ""]
    fixed = fixed_saving_table(scaling)
    if fixed:
        lines += ["Least-loss mix for a fixed time saving (KnapSpec's knapsack, same similarity profile):", "",
                  fixed, ""]
    lines += [f"- {f}" for f in scaling.get("findings", [])]
    defs = scaling.get("definitions")
    if defs:
        lines += ["", "## Definitions", ""] + [f"- **{k}**: {v}" for k, v in defs.items()]
    return "\n".join(lines) + "\n"


def scaling_figure(scaling: dict) -> go.Figure:
    """Decode tokens/s against prompt length per strategy; KnapSpec's skipped attention on a 2nd axis."""
    fig = go.Figure()
    names = list(dict.fromkeys(n for p in scaling["points"] for n in p["strategies"]))
    xs = [p["prompt_tokens"] for p in scaling["points"]]
    for name in names:
        fig.add_trace(go.Scatter(name=name, x=xs, mode="lines+markers",
                                 y=[p["strategies"].get(name, {}).get("decode_tokens_per_s")
                                    for p in scaling["points"]],
                                 line=dict(color=_colour(name))))
    sweep = scaling.get("knapspec_sweep") or []
    if sweep:
        fig.add_trace(go.Scatter(name="knapspec: attn sublayers skipped (model sweep)", yaxis="y2",
                                 x=[p["context_len"] for p in sweep], y=[p["attn"] for p in sweep],
                                 mode="lines", line=dict(dash="dot", color=_colour("knapspec"))))
        fig.add_trace(go.Scatter(name="knapspec: MLP sublayers skipped (model sweep)", yaxis="y2",
                                 x=[p["context_len"] for p in sweep], y=[p["mlp"] for p in sweep],
                                 mode="lines", line=dict(dash="dash", color="#aec7e8")))
    fig.update_layout(title="Decode tokens/s against prompt length", xaxis_title="prompt tokens",
                      yaxis_title="decode tokens/s", template="plotly_white",
                      yaxis2=dict(title="sublayers skipped", overlaying="y", side="right", rangemode="tozero"),
                      legend=dict(orientation="h", y=-0.2))
    return fig


# --- the one function that writes --------------------------------------------------------------
def save_figures(figs: dict[str, go.Figure], out_dir, png: bool = True) -> dict:
    """Write each figure as `<name>.html` (plotly.js from its CDN) and, if kaleido works, `<name>.png`.

    Returns {"html": [paths], "png": [paths], "png_skipped": reason or None}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"html": [], "png": [], "png_skipped": None}
    for name, fig in figs.items():
        path = out / f"{name}.html"
        fig.write_html(str(path), include_plotlyjs="cdn", full_html=True)
        written["html"].append(str(path))
    if not png:
        written["png_skipped"] = "disabled"
        return written
    try:
        import kaleido  # noqa: F401
    except ImportError:
        written["png_skipped"] = "kaleido is not installed"
        return written
    for name, fig in figs.items():
        path = out / f"{name}.png"
        try:
            fig.write_image(str(path), width=1000, height=520)
        except Exception as exc:  # kaleido present but unusable (e.g. no browser): skip, say why
            written["png_skipped"] = f"{type(exc).__name__}: {exc}"
            break
        written["png"].append(str(path))
    return written


# --- rendering a folder -------------------------------------------------------------------------
def _answers(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def render(folder, png: bool = True) -> dict:
    """Tables and figures of a bench folder (summary.json, <strategy>.jsonl) and / or a scaling folder
    (scaling.json): writes results.md / scaling.md and the figures there.

    Returns {"table": the markdown tables, "figures": what save_figures wrote}.
    """
    out = Path(folder)
    bench_file, scaling_file = out / "summary.json", out / "scaling.json"
    if not bench_file.exists() and not scaling_file.exists():
        raise FileNotFoundError(f"{out} holds neither summary.json (python -m ssd_core.bench) nor "
                                "scaling.json (python -m ssd_core.scaling)")
    tables, figs = [], {}
    if bench_file.exists():
        summary = json.loads(bench_file.read_text(encoding="utf-8"))
        answers = {name: _answers(out / f"{name}.jsonl") for name in summary["strategies"]}
        (out / "results.md").write_text(markdown_report(summary, answers), encoding="utf-8")
        tables.append(overall_table(summary) + "\n\n" + category_table(summary))
        figs.update(bench_figures(summary, answers))
    if scaling_file.exists():
        scaling = json.loads(scaling_file.read_text(encoding="utf-8"))
        report = scaling_report(scaling)
        (out / "scaling.md").write_text(report, encoding="utf-8")
        tables.append(report)
        figs["scaling"] = scaling_figure(scaling)
    return {"table": "\n\n".join(tables), "figures": save_figures(figs, out, png=png)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Render the tables and figures of a bench or scaling output folder.")
    ap.add_argument("folder", help="what python -m ssd_core.bench / ssd_core.scaling wrote (--out)")
    ap.add_argument("--no-png", action="store_true", help="HTML figures only (PNG needs kaleido)")
    args = ap.parse_args(argv)
    done = render(args.folder, png=not args.no_png)
    print(done["table"])
    figures = done["figures"]
    print(f"\nwrote {len(figures['html'])} HTML and {len(figures['png'])} PNG figures to {args.folder}"
          + (f" (PNG skipped: {figures['png_skipped']})" if figures["png_skipped"] else ""))


if __name__ == "__main__":
    main()
