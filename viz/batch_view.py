"""The cost panel's batch dimension: what speculation buys when several visitors share one batched pass.

Alone, verifying γ + 1 tokens costs little more than one token's step, so drafting pays; in a batch the
packed verify pass carries rows × (γ + 1) tokens and is no longer nearly free, so the serving engine's
goodput rule (ssd_core.engine.goodput) drafts less, then not at all. The figure plots its prediction
(GoodputRule.curve: rows → best γ, speedup over plain batched decoding) against the number of visitors
decoding together, beside drafting at the run's own γ regardless. Pure: data in, a figure out.
"""
from __future__ import annotations

import plotly.graph_objects as go

from .theme import ACCEPTED, GRID, INK, MUTED, REJECTED, base_layout


def speculation_off_at(curve: list[dict]) -> int | None:
    """The fewest rows from which the rule drafts nothing for every larger batch (None: it drafts at every size)."""
    off = None
    for point in reversed(curve):
        if point["gamma"] != 0:
            break
        off = point["rows"]
    return off


def batch_words(curve: list[dict], gamma: int) -> str:
    """One line: the rule's speedup alone, and from how many visitors it turns speculation off."""
    if not curve:
        return ""
    alone, off = curve[0], speculation_off_at(curve)
    first = (f"alone {alone['speedup']:.2f}× (draft length {alone['gamma']})" if alone["gamma"]
             else "alone the rule already drafts nothing at this acceptance")
    if off is None:
        return f"{first}; still drafting at {curve[-1]['rows']} visitors ({curve[-1]['speedup']:.2f}×)"
    if off == curve[0]["rows"]:
        return first
    return f"{first}; from {off} visitors plain batched decoding (drafting γ = {gamma} regardless: " \
           f"{next(p['fixed_gamma_speedup'] for p in curve if p['rows'] == off):.2f}×)"


def batch_figure(curve: list[dict], gamma: int, alpha: float, ratio: float, *, rows_here: float | None = None,
                 provisional: bool = False, alpha_source: str = "this run", height: int = 300) -> go.Figure:
    """curve: GoodputRule.curve(alpha, gamma, ratio) — [{rows, gamma, speedup, tokens_per_s,
    fixed_gamma_speedup}]; rows_here: the mean number of rows this run's steps shared (None: no run)."""
    rows = [p["rows"] for p in curve]
    fig = go.Figure()
    off = speculation_off_at(curve)
    top = max([1.2] + [p["speedup"] for p in curve] + [p["fixed_gamma_speedup"] for p in curve]) * 1.3
    if off is not None:                      # where the rule turns speculation off: a grey band
        fig.add_vrect(x0=off - 0.5, x1=rows[-1] + 0.5, fillcolor=GRID, opacity=0.55, line_width=0, layer="below")
        fig.add_annotation(x=(off - 0.5 + rows[-1] + 0.5) / 2, y=top, yanchor="top", showarrow=False,
                           text=f"speculation off from {off} visitor{'s' if off != 1 else ''}",
                           font=dict(size=10, color=MUTED))
    fig.add_hline(y=1.0, line=dict(color=INK, width=1.5))
    fig.add_annotation(x=rows[-1] + 0.5, xanchor="right", y=1.0, yanchor="bottom", showarrow=False,
                       text="plain batched decoding (1×)", font=dict(size=10, color=MUTED))
    fig.add_trace(go.Scatter(
        x=rows, y=[p["fixed_gamma_speedup"] for p in curve], mode="lines+markers", name=f"always γ = {gamma}",
        line=dict(color=REJECTED.key, width=2, dash="dash"), marker=dict(size=5, symbol="x"),
        hovertemplate=f"%{{x}} visitors, drafting γ = {gamma} regardless:<br>predicted %{{y:.2f}}× "
                      "plain batched decoding<extra></extra>"))
    fig.add_trace(go.Scatter(
        x=rows, y=[p["speedup"] for p in curve], mode="lines+markers", name="goodput rule (draft length per step)",
        line=dict(color=ACCEPTED.key, width=3), marker=dict(size=7),
        customdata=[[p["gamma"], p["tokens_per_s"]] for p in curve],
        hovertemplate="%{x} visitors: the rule drafts %{customdata[0]} per step<br>predicted %{y:.2f}× plain "
                      "batched decoding, %{customdata[1]:.0f} tokens/s for all<extra></extra>"))
    if rows_here is not None and curve:
        at = min(curve, key=lambda p: abs(p["rows"] - rows_here))
        fig.add_trace(go.Scatter(
            x=[at["rows"]], y=[at["speedup"]], mode="markers+text", name="this run",
            text=[f"this run ({rows_here:.1f} rows)" if abs(rows_here - round(rows_here)) >= 0.05 else
                  f"this run ({round(rows_here)} row{'s' if round(rows_here) != 1 else ''})"],
            textposition="top right" if at["rows"] < rows[-1] * 0.7 else "top left",
            textfont=dict(size=10, color=INK),
            marker=dict(symbol="star", size=15, color=INK, line=dict(color="#fff", width=1)),
            hovertemplate=(f"this run: its steps shared with {rows_here - 1:.1f} others on average<br>"
                           f"the rule's draft length there: {at['gamma']}<extra></extra>")))
    costs = ("provisional costs: built in, this machine's are still being measured" if provisional
             else "packed-pass costs measured on this machine")
    lines = (batch_words(curve, gamma),
             f"model drafts read {ratio:.0%} of the weights; prompt-lookup drafts are free and not counted · {costs}")
    for i, line in enumerate(lines):
        fig.add_annotation(x=0, xref="paper", xanchor="left", xshift=-38, y=1, yref="paper", yanchor="bottom",
                           yshift=4 + 15 * (len(lines) - 1 - i), showarrow=False, text=line,
                           font=dict(size=11, color=MUTED))
    title = (f"In a shared batch: predicted speedup over plain batched decoding (α {alpha:.2f} {alpha_source}, "
             f"γ ≤ {gamma})")
    fig.update_layout(**base_layout(title, height, showlegend=True,
                                    legend=dict(orientation="h", x=0.0, y=-0.22, font=dict(size=11))))
    fig.update_layout(margin=dict(l=50, r=10, t=72, b=70))
    fig.update_xaxes(title_text="visitors decoding together (rows in one batch)", range=[0.5, rows[-1] + 0.5],
                     dtick=1 if len(rows) <= 16 else None, gridcolor=GRID, fixedrange=True, zeroline=False)
    fig.update_yaxes(title_text="speedup ×", range=[0, top], gridcolor=GRID, fixedrange=True, zeroline=False)
    return fig


def empty_figure(why: str, height: int = 300) -> go.Figure:
    """The panel before it can say anything (no calibration: no acceptance to start from)."""
    fig = go.Figure()
    fig.update_layout(**base_layout(f"In a shared batch · {why}", height))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig
